"""``drafttrain import``: a draft another trainer wrote (speculators' DFlash, ...) as a drafttrain checkpoint, which
then evaluates, exports and trains like our own.

The kind's reader of the folder's format (drafttrain.drafts.codecs.ForeignReader) says how, and checks it
against the target first (hidden size, vocabulary, tapped layers), naming the first thing that disagrees. The
checkpoint is written all or nothing, with a manifest saying where it came from, then loaded back with every check
``load_drafter`` makes, and its weights compared with the source's: nothing is dropped that the draft uses.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.drafts import drafter_for, load_drafter
from drafttrain.drafts.foreign import foreign_kind, recognised_foreign
from drafttrain.export.writer import publish, staging_for
from drafttrain.runfolder import CONFIG_NAME, WEIGHTS_NAME, file_sha256, read_json, read_safetensors, write_manifest
from drafttrain.targets import Target


def read_foreign(source: Path, target: Target) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """The folder's config, the draft's tensors and the file they come from."""
    if (source / CONFIG_NAME).is_file():
        config = read_json(source / CONFIG_NAME)
        found = recognised_foreign(config) if isinstance(config, dict) and "drafttrain" not in config else None
        within = found[1].folder_tensors(source, config, target) if found else None
        if within is not None:  # a model folder that ships its own draft among its weights
            return config, *within
    if (source / CONFIG_NAME).is_file() and not (source / WEIGHTS_NAME).is_file():
        others = sorted(p.name for p in source.glob("*.safetensors"))
        pickles = sorted(p.name for p in source.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if others:
            raise DrafttrainError(f"{source} holds its weights as {others[0]}: name the file {WEIGHTS_NAME} (one "
                                  "file with every weight) to import it")
        if pickles:
            raise DrafttrainError(f"{source} holds its weights as {pickles[0]}, a pickle, which drafttrain never "
                                  f"loads (it can run code): convert it to {WEIGHTS_NAME} first (with safetensors, in "
                                  "a sandbox)")
    if not (source / CONFIG_NAME).is_file() or not (source / WEIGHTS_NAME).is_file():
        raise DrafttrainError(f"{source} holds no draft to import: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    config = read_json(source / CONFIG_NAME)
    if isinstance(config.get("drafttrain"), dict):
        raise DrafttrainError(f"{source} was written by drafttrain: evaluate, export or train from it directly")
    tensors, _ = read_safetensors(source / WEIGHTS_NAME)
    return config, tensors, source / WEIGHTS_NAME


def import_draft(source: str | Path, target: Target, out: str | Path, overwrite: bool = False) -> tuple[Path, list[str]]:
    """Write the foreign draft at ``source`` as a drafttrain checkpoint at ``out`` for ``target``. Returns the
    folder and the notes on what drafttrain serves differently from the trainer that wrote it."""
    source, out = Path(source), Path(out)
    staging = staging_for(out, overwrite)
    config, tensors, weights = read_foreign(source, target)
    kind, reader = foreign_kind(config, source)
    fmt = reader.format_of(config)
    try:
        draft, config, tensors, notes = reader.read_foreign(config, tensors, target)
    except (KeyError, TypeError, ValueError) as err:
        raise DrafttrainError(f"{source / CONFIG_NAME} does not describe a {kind.kind} draft in {fmt}'s format "
                              f"({type(err).__name__}: {err})") from None
    origin = {"path": str(source), "format": fmt, "weights_sha256": file_sha256(weights)}
    with tempfile.TemporaryDirectory(prefix="drafttrain-import-") as tmp:
        drafter = _built(kind, draft, config, tensors, target, Path(tmp))
        _check_float_weights(drafter, tensors, source)
        drafter.save_pretrained(staging, imported=origin)
    write_manifest(staging, {"imported": origin, **drafter.identity()})
    loaded = load_drafter(staging, target, as_saved=True)
    _check_weights_kept(loaded, tensors, source)
    publish(staging, out)
    return out, notes


def _built(kind, draft, config: dict, tensors: dict[str, torch.Tensor], target: Target, tmp: Path):
    """The kind's draft, loaded the way its own checkpoints load, from its section, the foreign config and the
    tensors in its layout."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_NAME))
    (tmp / CONFIG_NAME).write_text(json.dumps(
        {**config, "drafttrain": {"kind": kind.kind, "draft": draft.model_dump(mode="json")}}))
    return drafter_for(draft).from_pretrained(tmp, target)


def _check_float_weights(drafter, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """A weight the draft holds in floating point must be written in floating point: loading casts an int32 or
    quantised tensor into it without a word, and the draft computes with its raw integers."""
    own = drafter.state_dict()
    wrong = [(name, tensor.dtype) for name, tensor in tensors.items()
             if name in own and own[name].is_floating_point() and not tensor.is_floating_point()]
    if wrong:
        listed = ", ".join(f"{name} ({str(dtype).removeprefix('torch.')})" for name, dtype in wrong[:5])
        raise DrafttrainError(f"{source / WEIGHTS_NAME} holds {listed} where the draft's weights are floating point "
                              "(an integer or quantised tensor, which drafttrain does not dequantise): give the draft "
                              "in float32, bfloat16 or float16")


def _check_weights_kept(drafter, tensors: dict[str, torch.Tensor], source: Path) -> None:
    mine = drafter.state_tensors()
    lost = sorted(k for k in tensors if k not in mine)
    changed = sorted(k for k in tensors if k in mine and not torch.equal(mine[k].float(), tensors[k].float()))
    if lost or changed:
        raise DrafttrainError(f"{source / WEIGHTS_NAME} has weights the imported draft does not hold as they are "
                              f"(dropped {lost[:5]}, changed {changed[:5]})")
