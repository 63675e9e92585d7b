"""Target features for training: online (the frozen target runs inside the step) or from an offline cache.

The offline cache is sharded safetensors written once by ``write_feature_cache`` (``drafttrain prepare`` with
``training.hidden_states: offline``): per row, the draft's taps and the target's final normed hidden state, from
which the logits are recomputed with the target's lm_head (storing V-wide logits would be ~100× larger).
An index.json records shapes, the target and a sha256 per shard, so a stale or corrupt cache is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from drafttrain import DrafttrainError
from drafttrain.atomic import write_text_atomic
from drafttrain.drafts.base import TargetFeatures
from drafttrain.targets.hidden import HiddenStateTap

INDEX = "index.json"
FEATURE_CACHE = "features"  # under output_dir


@torch.no_grad()
def compute_features(target, batch: dict[str, torch.Tensor], layers: list[int]) -> TargetFeatures:
    """Run the frozen target once: the taps for ``layers`` and the next-token logits."""
    device = target.device
    with HiddenStateTap(target.model, layers) as tap:
        out = target.model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device) if "attention_mask" in batch else None,
            use_cache=False,
        )
        hidden = tap.stacked()
    return TargetFeatures(hidden=hidden, logits=out.logits)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def write_feature_cache(target, dataset, layers: list[int], out_dir: str | Path, rows_per_shard: int = 256,
                        dtype: torch.dtype = torch.bfloat16) -> Path:
    """Run the target over every row of a tokenised dataset and store its features. Each shard and the index
    are written to a temporary name and renamed, so a killed run never leaves a half-written file in place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final_layer = target.num_layers
    taps = list(layers) + ([final_layer] if final_layer not in layers else [])
    index = {"target": target.name, "layers": list(layers), "hidden_size": target.hidden_size,
             "num_rows": len(dataset), "dtype": str(dtype).removeprefix("torch."), "shards": []}
    shard_rows: dict[str, torch.Tensor] = {}
    shard_id = 0

    def flush():
        nonlocal shard_rows, shard_id
        name = f"shard-{shard_id:05d}.safetensors"
        tmp = out_dir / (name + ".tmp")
        save_file(shard_rows, str(tmp))
        os.replace(tmp, out_dir / name)
        index["shards"].append({"file": name, "sha256": _sha256(out_dir / name), "rows": sorted(
            {int(k.split(".")[0].removeprefix("row")) for k in shard_rows})})
        shard_rows, shard_id = {}, shard_id + 1

    for row in tqdm(range(len(dataset)), desc="target features", unit="row"):
        ids = torch.tensor(dataset[row]["input_ids"]).unsqueeze(0)
        with HiddenStateTap(target.model, taps) as tap:
            target.model(input_ids=ids.to(target.device), use_cache=False)
            captured = tap.get()
        shard_rows[f"row{row}.hidden"] = torch.cat(captured[: len(layers)], dim=-1)[0].to(dtype).cpu().contiguous()
        shard_rows[f"row{row}.final"] = captured[-1][0].to(dtype).cpu().contiguous()
        if len(shard_rows) >= 2 * rows_per_shard:
            flush()
    if shard_rows:
        flush()
    write_text_atomic(out_dir / INDEX, json.dumps(index, indent=1))
    return out_dir


class FeatureCache:
    """Streams features of given rows from the cache (memory-mapped shards, verified once each)."""

    def __init__(self, directory: str | Path, target, layers: list[int]):
        self.directory = Path(directory)
        path = self.directory / INDEX
        if not path.is_file():
            raise DrafttrainError(f"no feature cache at {self.directory} ({INDEX} missing): run `drafttrain prepare`")
        self.index = json.loads(path.read_text())
        if self.index["hidden_size"] != target.hidden_size:
            raise DrafttrainError(
                f"feature cache {self.directory} has hidden size {self.index['hidden_size']}, "
                f"the target has {target.hidden_size}: it was written for another target"
            )
        if list(self.index["layers"]) != list(layers):
            raise DrafttrainError(
                f"feature cache {self.directory} holds layers {self.index['layers']}, the draft needs {list(layers)}"
            )
        self.target = target
        self._row_shard = {r: s["file"] for s in self.index["shards"] for r in s["rows"]}
        self._verified: set[str] = set()

    def _open(self, name: str):
        path = self.directory / name
        if name not in self._verified:
            expected = next(s["sha256"] for s in self.index["shards"] if s["file"] == name)
            if not path.is_file() or _sha256(path) != expected:
                raise DrafttrainError(f"feature cache shard {path} is missing or corrupt (sha256 mismatch)")
            self._verified.add(name)
        return safe_open(str(path), framework="pt")

    def row(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        if row not in self._row_shard:
            raise DrafttrainError(f"feature cache {self.directory} has no row {row}")
        with self._open(self._row_shard[row]) as f:
            return f.get_tensor(f"row{row}.hidden"), f.get_tensor(f"row{row}.final")

    @torch.no_grad()
    def features(self, rows: list[int], seq_len: int) -> TargetFeatures:
        """Right-padded batch features; logits recomputed from the final hidden with the target's lm_head."""
        hiddens, finals = zip(*(self.row(r) for r in rows))
        dtype, device = self.target.model.dtype, self.target.device

        def pad(xs):
            out = torch.zeros(len(xs), seq_len, xs[0].shape[-1], dtype=dtype)
            for i, x in enumerate(xs):
                out[i, : min(seq_len, x.shape[0])] = x[:seq_len].to(dtype)
            return out.to(device)

        final = pad(finals)
        logits = self.target.model.get_output_embeddings()(final)
        return TargetFeatures(hidden=pad(hiddens), logits=logits)
