"""Drafts other tools wrote (speculators, SpecForge, EAGLE's trainer, vLLM's Medusa layout): recognised by the kinds'
foreign readers from a folder's config.json, for ``drafttrain import``."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from drafttrain import DrafttrainError
from drafttrain.drafts.base import Drafter
from drafttrain.drafts.codecs import ForeignReader, readers_of
from drafttrain.drafts.registry import KINDS
from drafttrain.runfolder import CONFIG_NAME, WEIGHTS_NAME, read_json


def recognised_foreign(config: dict) -> tuple[type[Drafter], ForeignReader] | None:
    """The kind of a draft folder another tool wrote and the reader of its format, when a reader recognises its
    config.json (None: no draft format drafttrain imports)."""
    return next(((kind, reader) for kind in KINDS.values() for reader in readers_of(kind) if reader.recognises(config)),
                None)


def foreign_draft(path: str | Path) -> tuple[type[Drafter], str] | None:
    """The kind and format of a draft another tool wrote at ``path``, which ``drafttrain import`` reads; None for
    anything else (a drafttrain draft, a whole model, no model folder). A folder whose config is a plain Llama's
    (as EAGLE-1's trainer writes a head's) is a whole model when its weights hold the model's layers ("model.*")."""
    folder = Path(path).expanduser()
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        return None
    config = read_json(folder / CONFIG_NAME)
    found = recognised_foreign(config) if isinstance(config, dict) and "drafttrain" not in config else None
    if found is None:
        return None
    try:
        with safe_open(str(folder / WEIGHTS_NAME), "pt") as tensors:
            whole_model = any(name.startswith("model.") for name in tensors.keys())
    except (OSError, SafetensorError):
        return None  # unreadable weights: the path that loads it names the file
    return None if whole_model else (found[0], found[1].format_of(config))


def foreign_kind(config: dict, where: Path) -> tuple[type[Drafter], ForeignReader]:
    """The kind of a draft folder another tool wrote, and the reader of its format, from its config.json."""
    found = recognised_foreign(config)
    if found is None:
        known = {k: list(dict.fromkeys(f for r in readers_of(c) for f in r.formats)) for k, c in KINDS.items()}
        raise DrafttrainError(f"{where / CONFIG_NAME} is not a draft format drafttrain imports (known: "
                              + ", ".join(f"{k}: {', '.join(fmts)}" for k, fmts in known.items() if fmts) + ")")
    return found
