"""The draft kinds: one line each. A kind's class says everything about it (drafttrain.drafts.base.Drafter)."""

from __future__ import annotations

from pathlib import Path

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig
from drafttrain.drafts.base import Drafter, read_draft_config
from drafttrain.drafts.eagle import EagleDrafter
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.runfolder import RunFolder, find_draft

KINDS: dict[str, type[Drafter]] = {
    Eagle3Drafter.kind: Eagle3Drafter,
    EagleDrafter.kind: EagleDrafter,
}


def drafter_class(kind: str) -> type[Drafter]:
    if kind not in KINDS:
        raise DrafttrainError(f"unknown draft kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
    return KINDS[kind]


def build_drafter(config: DraftConfig, target, run: RunFolder | None = None) -> Drafter:
    """A fresh draft of the recipe's kind for ``target`` (``run``: the run folder prepare wrote)."""
    return drafter_class(config.kind).build(config, target, run)


def saved_kind(path: str | Path) -> type[Drafter]:
    """The kind of the draft a checkpoint folder, ``checkpoints/`` folder or run folder holds."""
    return drafter_class(read_draft_config(find_draft(path))["drafttrain"]["kind"])


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a saved draft of any kind and attach ``target`` (checked against what the draft was trained for).
    ``path`` may also be a run's output_dir or checkpoints folder: its best checkpoint is loaded."""
    directory = find_draft(path)
    return saved_kind(directory).from_pretrained(directory, target)
