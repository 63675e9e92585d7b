"""speculators' offline layout, written and read by the offline cache (``training.cache_layout: speculators``,
``training.cache_from``), so a capture made for one trainer trains in the other.

As speculators 0.9.0 reads it (``speculators.train.data.ArrowDataset`` over ``--data-path DIR``): ``DIR`` is a
prepared dataset (``datasets.save_to_disk``, torch format: ``input_ids`` and ``loss_mask`` int64 per row,
``seq_len``), and row i's target states are ``DIR/hidden_states/hs_{i}.safetensors``: ``token_ids [T]`` (int64,
equal to the row's ``input_ids`` or the row is skipped) and ``hidden_states [T, k + 1, H]``: the k taps the draft
reads (its ``target_layer_ids``: vLLM's ids, id n the input of decoder layer n, as drafttrain's), then the final
state *before* the final norm (its verifier applies the norm). The states keep the dtype they were captured in.

drafttrain's index over such files (``index.json``) records the layout, the layer of each slot and each row's file,
so it reads files it wrote and files speculators wrote alike; a speculators file is given to the drafttrain row with
the same token ids, never by position.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import datasets
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.sources.base import PRENORM
from drafttrain.targets.outputs import TargetNeeds

HIDDEN_DIR = "hidden_states"
FP8_SCALES = "hidden_states_scales"  # hs_connectors' FP8 connector: a float32 scale per token beside float8 states


def row_file(row: int) -> str:
    """Row ``row``'s file, relative to the folder of the prepared dataset."""
    return f"{HIDDEN_DIR}/hs_{row}.safetensors"


def slot_layers(needs: TargetNeeds, num_layers: int) -> list[int]:
    """The layer of each slot of a row's file: the kind's taps in its order, then the final state (id num_layers)."""
    return [layer for layer in dict.fromkeys(needs.layers) if layer != num_layers] + [num_layers]


def layout_refusal(needs: TargetNeeds) -> str | None:
    """Why a cache with these needs cannot be written in speculators' layout (None: it can). Its dtypes are
    drafttrain's but float8 (training.feature_dtype refuses that one)."""
    if needs.logits and needs.logits_top_k is not None:
        return ("speculators' layout holds hidden states only, not a teacher's top-k logits: write this cache in "
                "drafttrain's layout (training.cache_layout: drafttrain, no training.cache_from)")
    return None


def write_row(folder: Path, row: int, ids: list[int], entries: dict[str, torch.Tensor], layers: list[int],
              num_layers: int, dtype: torch.dtype) -> str:
    """Row ``row``'s file from a source's entries (its taps, and ``prenorm`` for the final slot), written under a
    temporary name and renamed so that neither trainer reads half a file. Returns its path relative to ``folder``."""
    slots = [entries[PRENORM] if layer == num_layers else entries[f"layer{layer}"] for layer in layers]
    hidden = torch.stack([s.to(dtype).cpu() for s in slots], dim=1).contiguous()
    if hidden.shape[0] != len(ids):
        raise DrafttrainError(f"row {row}: the source gave states for {hidden.shape[0]} tokens, the row has {len(ids)}")
    name = row_file(row)
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": torch.tensor(ids, dtype=torch.long), "hidden_states": hidden}, str(path) + ".tmp")
    path.with_name(path.name + ".tmp").replace(path)
    return name


def read_row(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids, hidden_states) of a file in speculators' layout; states of its FP8 connector are dequantised."""
    with safe_open(str(path), framework="pt") as f:
        tokens, hidden = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
        if FP8_SCALES in f.keys():
            hidden = hidden.float() * f.get_tensor(FP8_SCALES).float()
    return tokens, hidden


def write_prepared_dataset(train, folder: Path) -> None:
    """The train split as speculators' prepared dataset (``prepare-data``'s columns, torch format) in ``folder``,
    row i beside ``hidden_states/hs_{i}.safetensors``; its loss mask says which tokens train (drafttrain's loss
    weights are its own)."""
    def columns(batch):
        return {"input_ids": batch["input_ids"], "loss_mask": [[int(w > 0) for w in m] for m in batch["loss_mask"]],
                "seq_len": [len(ids) for ids in batch["input_ids"]]}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar for a copy of token ids is noise beside the capture's
    try:
        rows = train.select_columns(["input_ids", "loss_mask"]).map(columns, batched=True, features=features,
                                                                   remove_columns=["input_ids", "loss_mask"],
                                                                   keep_in_memory=True)
        rows.set_format(type="torch")
        rows.save_to_disk(str(folder))
    finally:
        if bars:
            datasets.enable_progress_bars()


# -- a capture speculators made --------------------------------------------------------------------------------


def _digest(ids) -> bytes:
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.long).numpy().tobytes()).digest()


def capture_files(where: str | Path) -> list[Path]:
    """The ``hs_{i}.safetensors`` files of a speculators capture: ``where`` is its data folder (files under
    ``hidden_states/``) or the folder of the files."""
    where = Path(where).expanduser()
    folder = where / HIDDEN_DIR if (where / HIDDEN_DIR).is_dir() else where
    if not folder.is_dir():
        raise DrafttrainError(f"training.cache_from: {where} is not a folder")
    files = sorted(folder.glob("hs_*.safetensors"), key=lambda p: (len(p.name), p.name))
    if not files:
        raise DrafttrainError(f"training.cache_from: {folder} holds no hs_{{i}}.safetensors files (speculators' "
                              "offline layout: <data-path>/hidden_states/hs_{i}.safetensors)")
    return files


def _shape_problem(path: Path, tokens: int, shape: list[int], layers: list[int], hidden_size: int) -> str | None:
    if len(shape) != 3 or shape[0] != tokens:
        return f"holds hidden_states of shape {shape} for {tokens} token ids, not [T, layers, H]"
    if shape[2] != hidden_size:
        return f"holds states {shape[2]} wide, the target's are {hidden_size}: it was captured from another target"
    if shape[1] != len(layers):
        return (f"holds {shape[1]} layers a token, the draft reads {len(layers)}: its taps {layers[:-1]} then the "
                f"final state {layers[-1]} (capture with those target layer ids)")
    return None


def match_rows(where: str | Path, train, layers: list[int], hidden_size: int) -> tuple[dict[int, str], list[int]]:
    """({train row: the file holding its token ids}, the rows none holds), every file checked for the target's
    width and the draft's number of layers (a file that cannot be read, or of another shape, is named)."""
    by_tokens: dict[bytes, str] = {}
    for path in capture_files(where):
        try:
            with safe_open(str(path), framework="pt") as f:
                tokens, shape = f.get_tensor("token_ids"), list(f.get_slice("hidden_states").get_shape())
        except (SafetensorError, OSError, KeyError) as err:
            raise DrafttrainError(f"training.cache_from: {path} cannot be read ({str(err).splitlines()[0][:200]}): "
                                  "delete it and capture its row again") from None
        problem = _shape_problem(path, len(tokens), shape, layers, hidden_size)
        if problem:
            raise DrafttrainError(f"training.cache_from: {path} {problem}")
        by_tokens.setdefault(_digest(tokens), str(path.resolve()))
    matched, missing, row = {}, [], 0
    for batch in train.select_columns(["input_ids"]).iter(batch_size=1000):
        for ids in batch["input_ids"]:
            found = by_tokens.get(_digest(ids))
            if found is None:
                missing.append(row)
            else:
                matched[row] = found
            row += 1
    return matched, missing


def check_match(path: str, row: int, ids: list[int], tokens: torch.Tensor) -> None:
    """A matched file holds the row's very token ids (a digest matched them first)."""
    if tokens.tolist() != list(ids):
        raise DrafttrainError(f"training.cache_from: {path} no longer holds train row {row}'s tokens: rerun "
                              "`drafttrain prepare`")


def describe_missing(where: str | Path, missing: list[int], rows: int) -> str:
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return (f"training.cache_from: {len(missing)} of {rows} train rows have no file with their token ids in {where} "
            f"(rows {shown}): the run's source computes them")
