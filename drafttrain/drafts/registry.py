"""One registry of draft kinds: each kind names its config class (recipe schema) and its head class."""

from __future__ import annotations

import importlib
from pathlib import Path

from drafttrain import DrafttrainError

# kind -> module defining it (imported on first use, so the schema stays cheap to import)
_KIND_MODULES = {
    "eagle3": "drafttrain.drafts.eagle3",
    "eagle": "drafttrain.drafts.eagle",
}
_REGISTRY: dict[str, type] = {}


def register_draft(cls):
    """Class decorator: ``@register_draft`` on a DraftHead subclass with ``kind`` and ``config_class``."""
    _REGISTRY[cls.kind] = cls
    return cls


def draft_class(kind: str):
    if kind not in _REGISTRY and kind in _KIND_MODULES:
        importlib.import_module(_KIND_MODULES[kind])
    if kind not in _REGISTRY:
        raise DrafttrainError(f"unknown draft kind {kind!r}; known kinds: {', '.join(sorted(_KIND_MODULES))}")
    return _REGISTRY[kind]


def draft_config_class(kind: str):
    try:
        return draft_class(kind).config_class
    except DrafttrainError as err:
        raise ValueError(str(err)) from None  # surfaces as a recipe validation error on draft.kind


def known_kinds() -> list[str]:
    return sorted(_KIND_MODULES)


def build_draft(draft_config, target, **context):
    """A fresh head for ``target`` from the recipe's draft section (``context``: e.g. output_dir)."""
    return draft_class(draft_config.kind).build(draft_config, target, **context)


def load_draft(directory: str | Path, target):
    """Load a saved head of any kind and attach ``target`` (checked against what the head was trained on).
    ``directory`` may also be a run's output_dir or checkpoints folder: its best checkpoint is loaded."""
    from drafttrain.drafts.base import read_draft_config
    from drafttrain.training.checkpoint import resolve_draft_dir

    directory = resolve_draft_dir(directory)
    config = read_draft_config(directory)
    return draft_class(config["drafttrain"]["kind"]).from_pretrained(directory, target)
