"""The run folder: every file a run writes, named in one place, and how files are written (atomically).

Layout of ``<output_dir>/`` (``RunFolder``)::

    regenerated.jsonl (+ .settings.json, .dropped.jsonl)   the target's answers      prepare
    data/train, data/validation                          tokenised splits (Arrow)    prepare
    data/validation_prompts.jsonl                        held-out first turns        prepare
    draft_vocab.safetensors                              d2t / t2d                   prepare
    features/                                            offline target outputs      prepare
    prepare_summary.json                                 every count of prepare      prepare
    metrics.jsonl, wandb_run_id                          training metrics            train
    checkpoints/step-NNNNNN/                             one checkpoint              train
        model.safetensors, config.json                     the draft (what eval and export load)
        trainer_state.json                                 where training stands (written last: commit marker)
        accelerate/                                        optimizer, scheduler, RNG (ZeRO shards per rank)
        eval.json, eval/                                   its evaluation
    checkpoints/latest, checkpoints/best.json            pointers
    eval/                                                the final report                quickstart

A checkpoint folder named ``step-N`` is always complete: it is written as ``step-N.tmp`` and renamed once every
file is on disk (see drafttrain.training.checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from drafttrain import DrafttrainError

WEIGHTS_NAME = "model.safetensors"  # a draft's weights
CONFIG_NAME = "config.json"  # a draft's config (the interchange config + a "drafttrain" section)
STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate"
EVAL_FILE = "eval.json"
EVAL_DIR = "eval"
LATEST = "latest"
BEST = "best.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def of(cls, output_dir: str | Path) -> "RunFolder":
        return cls(Path(output_dir).expanduser())

    @property
    def regenerated(self) -> Path:
        return self.root / "regenerated.jsonl"

    @property
    def train_split(self) -> Path:
        return self.root / "data" / "train"

    @property
    def validation_split(self) -> Path:
        return self.root / "data" / "validation"

    @property
    def validation_prompts(self) -> Path:
        return self.root / "data" / "validation_prompts.jsonl"

    @property
    def draft_vocab(self) -> Path:
        return self.root / "draft_vocab.safetensors"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def summary(self) -> Path:
        return self.root / "prepare_summary.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def wandb_id(self) -> Path:
        return self.root / "wandb_run_id"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def eval(self) -> Path:
        return self.root / EVAL_DIR

    def data_cache(self, configured: str | None) -> Path:
        """The tokenised-data cache: ``data.cache_dir`` when the recipe sets one, else ``cache/`` in the run."""
        return Path(configured).expanduser() if configured else self.root / "cache"


def cache_root() -> Path:
    """The user cache shared by runs (converted built-in targets, tokenised data): $DRAFTTRAIN_CACHE, else
    ~/.cache/drafttrain."""
    return Path(os.environ.get("DRAFTTRAIN_CACHE", Path.home() / ".cache" / "drafttrain"))


# ------------------------------------------------------------------------------------------------ checkpoints


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under a ``checkpoints/`` folder, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def best_checkpoint_record(root: Path) -> dict | None:
    """``best.json`` of a ``checkpoints/`` folder when the checkpoint it names still exists."""
    path = root / BEST
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if (root / record["checkpoint"]).is_dir() else None


def find_draft(path: str | Path) -> Path:
    """The draft checkpoint a user means: the folder itself when it holds a draft; for a run's ``checkpoints/``
    folder or its output_dir, the best checkpoint by the run's eval metric, else the newest complete one."""
    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    best, done = best_checkpoint_record(root), complete_checkpoints(root)
    if best is not None:
        return root / best["checkpoint"]
    if done:
        return done[-1][1]
    raise DrafttrainError(f"no draft checkpoint at {path}: neither a draft folder ({CONFIG_NAME}) nor a run with "
                          "complete checkpoints")


# ------------------------------------------------------------------------------------------------ atomic writes


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (and root itself) to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def write_text_atomic(path: Path, text: str) -> None:
    """Write-then-rename, so a killed process never leaves a half-written file under its final name."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
