"""Checkpoint folders: atomic writes, a ``latest`` pointer, keep-last-N pruning that spares the best one.

The layout of ``<output_dir>/checkpoints/`` is drafttrain.runfolder's. A checkpoint is written into
``step-N.tmp`` and renamed to ``step-N`` once every file is fsynced; the rename is the commit point, so a folder
named ``step-N`` is always complete and a crash mid-save leaves only a ``.tmp`` orphan (removed on the next
start). Pruned folders are renamed to ``.old`` before deletion for the same reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from drafttrain import DrafttrainError
from drafttrain.config import DRAFT_SECTIONS, TargetConfig
from drafttrain.runfolder import (
    BEST,
    EVAL_FILE,
    LATEST,
    MANIFEST,
    STATE_FILE,
    best_checkpoint_record,
    complete_checkpoints,
    damaged,
    fsync_dir,
    fsync_tree,
    read_json,
    step_dir_name,
    verify_manifest,
    write_text_atomic,
)
from drafttrain.userfiles import remove

log = logging.getLogger(__name__)

_ORPHAN_SUFFIXES = (".tmp", ".old")
DAMAGED_SUFFIX = ".damaged"  # a checkpoint that failed verification on resume, set aside (never deleted)
DIVERGED_SUFFIX = ".diverged"  # the weights that produced a non-finite loss or gradient in the next step


@dataclasses.dataclass
class TrainerState:
    """Where training stands; with the data seed it fixes the rest of the data order exactly."""

    step: int  # optimizer steps done
    epoch: int
    batch_in_epoch: int  # global micro-batches of `epoch` already consumed
    data_seed: int
    num_rows: int
    batch_size: int  # per process
    world_size: int
    grad_accum: int
    total_steps: int
    train_seconds: float = 0.0  # training time so far (what a time budget counts)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def read(cls, path: Path) -> "TrainerState":
        raw = read_json(path)
        try:
            return cls(**{f.name: (float if f.type == "float" else int)(
                raw[f.name] if f.default is dataclasses.MISSING else raw.get(f.name, f.default))
                for f in dataclasses.fields(cls)})
        except (ValueError, KeyError, TypeError) as err:
            raise damaged(path, f"lacks or garbles a field ({type(err).__name__}: {err})") from None

    def resume_conflicts(self, now: "TrainerState", deepspeed: bool) -> list[str]:
        """Why this checkpoint cannot continue under the current setup (the data order would change)."""
        problems = []
        for name in ("data_seed", "num_rows", "grad_accum"):
            if getattr(self, name) != getattr(now, name):
                problems.append(f"{name} was {getattr(self, name)}, now {getattr(now, name)}")
        if self.batch_size * self.world_size != now.batch_size * now.world_size:
            was, now_ = f"{self.batch_size}×{self.world_size}", f"{now.batch_size}×{now.world_size}"
            problems.append(f"global batch was {was} processes, now {now_}")
        elif deepspeed and self.world_size != now.world_size:  # ZeRO shards are per rank
            problems.append(f"DeepSpeed checkpoint from {self.world_size} processes, now {now.world_size}")
        return problems


# A tie on the best metric goes to the higher held-out simulated tau, then to the newer checkpoint (trained longer):
# with `--depth auto` every checkpoint served as plain decoding measures tau 1.0, and the measured held-out
# acceptance still tells them apart.
TIE_BREAK = "sim_tau"


def _or_lowest(value: float | None) -> float:
    return float("-inf") if value is None else float(value)


class CheckpointManager:
    """Owns ``<output_dir>/checkpoints``. Folder operations are for the main process only; the trainer
    brackets them with barriers."""

    def __init__(self, root: str | Path, keep_last: int, best_metric: str | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.best_metric = best_metric

    # -- reading ------------------------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """Committed checkpoints, oldest first."""
        return complete_checkpoints(self.root)

    def latest(self, before: int | None = None) -> Path | None:
        """The newest committed checkpoint (older than step ``before``, when given). Found by scanning, since the
        rename is the commit point; the ``latest`` file is a convenience pointer that lags by at most one
        checkpoint after a crash."""
        done = [path for step, path in self.complete() if before is None or step < before]
        return done[-1] if done else None

    def best(self) -> dict[str, Any] | None:
        return best_checkpoint_record(self.root)

    def tmp_dir(self, step: int) -> Path:
        return self.root / (step_dir_name(step) + ".tmp")

    # -- writing (main process) ---------------------------------------------------------------------------
    def remove_orphans(self) -> list[Path]:
        """Delete folders of interrupted saves or prunes, and repair a stale ``latest`` pointer."""
        removed = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.is_dir() and path.name.endswith(_ORPHAN_SUFFIXES):
                    log.warning("removing incomplete checkpoint folder %s (left by an interrupted run)", path)
                    remove(path, "an incomplete checkpoint an interrupted run left")
                    removed.append(path)
        latest = self.latest()
        if latest is not None and self.read_pointer() != latest.name:
            write_text_atomic(self.root / LATEST, latest.name + "\n")
        return removed

    def read_pointer(self) -> str | None:
        path = self.root / LATEST
        return path.read_text().strip() if path.is_file() else None

    def begin(self, step: int) -> Path:
        tmp = self.tmp_dir(step)
        remove(tmp, "an unfinished save of the same step")
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int) -> Path:
        """Make the fully written ``.tmp`` folder the checkpoint for ``step`` (atomic rename), then point
        ``latest`` at it."""
        tmp, final = self.tmp_dir(step), self.root / step_dir_name(step)
        missing = [name for name in (STATE_FILE, MANIFEST) if not (tmp / name).is_file()]
        if missing:
            raise DrafttrainError(f"checkpoint {tmp} is incomplete ({', '.join(missing)} missing); not committing it")
        fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint)
            self._discard(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n")
        return final

    def resume_point(self, built_from: dict[str, Any]) \
            -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
        """The newest checkpoint that verifies (every file against its manifest checksum, a readable state), with
        what it was built from, and each newer one that was skipped with why. A checkpoint built from other data,
        another target or tokenizer is refused (that is another run, not damage)."""
        skipped = []
        for _, path in reversed(self.complete()):
            try:
                saved = verify_manifest(path)
                TrainerState.read(path / STATE_FILE)
            except DrafttrainError as why:
                skipped.append((path, f"skipped {path.name}: {why}"))
                continue
            other = [f"{what} {saved.get(what)} (now {now})" for what, now in built_from.items()
                     if what != "recipe" and saved.get(what) != now]
            if other:
                raise DrafttrainError(f"cannot resume from {path}: it was trained with another " + ", ".join(other)
                                      + "; use another output_dir for this run")
            return path, saved, skipped
        if skipped:
            raise DrafttrainError(f"no checkpoint under {self.root} verifies: " + "; ".join(w for _, w in skipped)
                                  + ". Delete them to start over, or use another output_dir")
        return None, None, []

    def set_aside(self, path: Path, suffix: str = ".damaged") -> Path:
        """Rename a checkpoint that must not be used to ``<name><suffix>`` (kept for inspection): it no longer
        counts as a checkpoint, so it is never the newest, never resolved for evaluation, and never kept by
        pruning in place of a good one."""
        aside, n = path.with_name(path.name + suffix), 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}{suffix}.{n}"), n + 1
        os.replace(path, aside)
        fsync_dir(self.root)
        log.warning("set aside checkpoint %s as %s", path.name, aside.name)
        return aside

    def record_metrics(self, checkpoint: Path, step: int, metrics: dict[str, float]) -> bool:
        """Store a checkpoint's eval metrics; returns True when it became the best by ``best_metric``."""
        write_text_atomic(checkpoint / EVAL_FILE, json.dumps(metrics, indent=2))
        return self.consider_best(checkpoint, step, metrics)

    def consider_best(self, checkpoint: Path, step: int, metrics: dict[str, float]) -> bool:
        """Make ``checkpoint`` the best one (best.json) when ``metrics`` beat the best one's by ``best_metric``;
        returns whether it did."""
        if self.best_metric is None or self.best_metric not in metrics:
            return False
        value = float(metrics[self.best_metric])
        tie_break = metrics.get(TIE_BREAK)
        current = self.best()
        if current is not None and current["metric"] == self.best_metric and \
                (value, _or_lowest(tie_break)) < (current["value"], _or_lowest(current.get(TIE_BREAK))):
            return False
        record = {"checkpoint": checkpoint.name, "step": step, "metric": self.best_metric, "value": value,
                  **({TIE_BREAK: float(tie_break)} if tie_break is not None else {})}
        write_text_atomic(self.root / BEST, json.dumps(record, indent=2))
        return True

    def prune(self) -> list[Path]:
        """Keep the newest ``keep_last`` checkpoints and the best one; delete the rest."""
        done = [path for _, path in self.complete()]
        best = self.best()
        keep = set(done[-self.keep_last :]) | ({self.root / best["checkpoint"]} if best else set())
        removed = [path for path in done if path not in keep]
        for path in removed:
            self._discard(path)
        return removed

    def _discard(self, path: Path) -> None:
        doomed = path.with_name(path.name + ".old")
        os.replace(path, doomed)  # atomic: a crash mid-delete leaves an orphan, never a half-deleted step-N
        remove(doomed, "a checkpoint pruned (keep_last) or saved again")


def _read_today(section: str, saved: Any) -> Any:
    """A fixed section as a run saved it, read as today's schema reads it (earlier keys under their new names, the
    draft's through its kind's ``from_saved``; keys added since at their defaults) and dumped as a recipe is. One
    today's schema cannot read stays as saved: compared key by key, it names what differs."""
    kinds = {cls.model_fields["kind"].default: cls for cls in DRAFT_SECTIONS}
    if not isinstance(saved, dict) or (section == "draft" and saved.get("kind") not in kinds):
        return saved
    try:
        read = kinds[saved["kind"]].from_saved(saved) if section == "draft" else TargetConfig.model_validate(saved)
    except ValidationError:
        return saved
    return read.model_dump(mode="json")


# Recipe sections a checkpoint cannot continue under if they changed: they define what its weights are.
_FIXED_SECTIONS = ("draft", "target")
_DEVICE_KEYS = ("device",)  # where the target runs may change between runs
# Training settings a resumed run applies from its recipe (and says so): the schedule is rebuilt from them.
APPLIED_ON_RESUME = ("learning_rate", "scheduler", "warmup_steps", "weight_decay", "max_steps", "epochs")


def recipe_changes(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes that make resuming impossible, changed training settings the resumed run applies), by name. The
    saved sections are compared as today's schema reads them, so a run saved under earlier keys resumes."""
    saved = {**saved, **{section: _read_today(section, saved.get(section)) for section in _FIXED_SECTIONS}}
    refused = [
        f"{section}.{key} was {saved.get(section, {}).get(key)!r}, now {now[section].get(key)!r}"
        for section in _FIXED_SECTIONS if now.get(section) is not None
        for key in sorted(set(saved.get(section) or {}) | set(now[section]))
        if key not in _DEVICE_KEYS and (saved.get(section) or {}).get(key) != now[section].get(key)
    ]
    applied = [
        f"training.{key} {saved.get('training', {}).get(key)!r} -> {now['training'].get(key)!r}"
        for key in APPLIED_ON_RESUME if saved.get("training", {}).get(key) != now["training"].get(key)
    ]
    return refused, applied
