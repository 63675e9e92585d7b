"""The run folder: every file a run writes, named in one place, and how files are written (atomically).

Layout of ``<output_dir>/`` (``RunFolder``)::

    regenerated.jsonl (+ .settings.json, .dropped.jsonl)   the target's answers      prepare
    data/train, data/validation                          tokenised splits (Arrow)    prepare
    data/validation_prompts.jsonl                        held-out first turns        prepare
    data/manifest.json                                   what the splits were built from  prepare
    draft_vocab.safetensors                              d2t / t2d                   prepare
    features/                                            offline target outputs      prepare
    prepare_summary.json                                 every count of prepare      prepare
    metrics.jsonl, wandb_run_id                          training metrics            train
    checkpoints/step-NNNNNN/                             one checkpoint              train
        model.safetensors, config.json                     the draft (what eval and export load)
        trainer_state.json                                 where training stands (written last: commit marker)
        accelerate/                                        optimizer, scheduler, RNG (ZeRO shards per rank)
        manifest.json                                      checksums of every file, and what it was built from
        eval.json, eval/                                   its evaluation
    checkpoints/latest, checkpoints/best.json            pointers
    eval/                                                the final report                quickstart

A checkpoint folder named ``step-N`` is always complete: it is written as ``step-N.tmp`` and renamed once every
file is on disk (see drafttrain.training.checkpoint).

Reading: every reader of a run-folder file goes through the functions below, which turn a decode error (JSON,
safetensors, Arrow) or a checksum mismatch into a DrafttrainError that names the file, the stage that wrote it and
how to recover, instead of a raw traceback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, ClassVar

from drafttrain import DrafttrainError

WEIGHTS_NAME = "model.safetensors"  # a draft's weights
CONFIG_NAME = "config.json"  # a draft's config (the interchange config + a "drafttrain" section)
STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate"
EVAL_FILE = "eval.json"
EVAL_DIR = "eval"
LATEST = "latest"
BEST = "best.json"
MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"  # the training log, one JSON object per line (appended)
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
    def data_manifest(self) -> Path:
        return self.root / "data" / MANIFEST

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
        return self.root / METRICS

    @property
    def wandb_id(self) -> Path:
        return self.root / "wandb_run_id"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def eval(self) -> Path:
        return self.root / EVAL_DIR

    @property
    def plots(self) -> Path:
        """``drafttrain report``'s PNG curves."""
        return self.root / "plots"

    def export(self, fmt: str) -> Path:
        """Where ``drafttrain push`` exports a run's best checkpoint before uploading it."""
        return self.root / "exports" / fmt

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> "RunFolder | None":
        """The run a checkpoint folder belongs to (None: a checkpoint outside a run)."""
        run = cls.of(checkpoint.parent.parent)
        return run if checkpoint.parent == run.checkpoints else None

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
    """``best.json`` of a ``checkpoints/`` folder when the checkpoint it names still exists. A damaged pointer is
    ignored (with a warning): the checkpoints themselves are still found by scanning."""
    path = root / BEST
    if not path.is_file():
        return None
    try:
        record = read_json(path)
        return record if (root / record["checkpoint"]).is_dir() else None
    except (DrafttrainError, KeyError, TypeError) as err:
        logging.getLogger(__name__).warning("ignoring %s: %s", path, err)
        return None


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


def drafttrain_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``path`` means when it is one written by drafttrain (a checkpoint, its run or checkpoints
    folder; see find_draft), else None (a plain model folder, a built-in name, a Hub id)."""
    try:
        directory = find_draft(path)
    except DrafttrainError:
        return None
    return directory if "drafttrain" in read_json(directory / CONFIG_NAME) else None


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


# ------------------------------------------------------------------------------------------------ reading, checked


def _writer_of(path: Path) -> tuple[str, str]:
    """(the command that writes this file, how to recover from its damage), judged from its path."""
    parts = path.parts
    for i, part in enumerate(parts):
        if _STEP_DIR.match(part.removesuffix(".tmp")):
            folder = Path(*parts[: i + 1])
            return "`drafttrain train`", (f"resume from an older checkpoint (`drafttrain train --resume` sets a "
                                          f"damaged one aside), or delete {folder}")
    if "tokenized" in parts:
        return "`drafttrain prepare`", "delete that cache folder; the next `drafttrain prepare` rebuilds it"
    if EVAL_DIR in parts:
        return "`drafttrain eval`", "rerun the evaluation"
    if path.name == METRICS:
        return "`drafttrain train`", "it is the run's log: a rerun of `drafttrain train --resume` appends to it"
    draft_file = path.name in (CONFIG_NAME, WEIGHTS_NAME, MANIFEST) or (path / CONFIG_NAME).is_file()
    if draft_file and not {"data", "features"} & set(parts):  # a draft folder outside a checkpoints/ folder
        return "`drafttrain train` or `drafttrain export`", ("copy the draft again from the run it came from, or "
                                                             "export it again (`drafttrain export RUN`)")
    return "`drafttrain prepare`", "rerun `drafttrain prepare` with this recipe to rebuild it"


def damaged(path: str | Path, problem: str) -> DrafttrainError:
    """The error for a run-folder file that cannot be used: names it, its writer and the way out."""
    writer, recover = _writer_of(Path(path))
    return DrafttrainError(f"{path} {problem} (written by {writer}): {recover}")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise damaged(path, "is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise damaged(path, f"is not valid JSON ({_first_line(err)})") from None


def read_safetensors(path: str | Path) -> tuple[dict, dict[str, str]]:
    """(tensors, metadata) of a safetensors file."""
    from safetensors import safe_open  # the foundation stays light: every module imports it

    path = Path(path)
    if not path.is_file():
        raise damaged(path, "is missing")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise damaged(path, f"cannot be read as safetensors ({_first_line(err)})") from None


def open_dataset(path: str | Path):
    """A tokenised split saved with ``datasets.save_to_disk``."""
    import datasets  # the foundation stays light: every module imports it

    path = Path(path)
    if not path.is_dir():
        raise damaged(path, "is missing")
    try:
        dataset = datasets.load_from_disk(str(path))
        len(dataset)  # touch the table: a truncated Arrow file fails here, not deep inside training
        return dataset
    except Exception as err:  # noqa: BLE001 - Arrow and datasets raise many types for damaged files
        raise damaged(path, f"cannot be read as a dataset ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


# ------------------------------------------------------------------------------------------------ manifests


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, built_from: dict[str, Any], skip: tuple[str, ...] = ()) -> Path:
    """``manifest.json``: size and sha256 of every file under ``folder`` (but ``skip``), and what it was built
    from (fingerprints of the data, target, tokenizer, recipe)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name != MANIFEST and name not in skip:
            files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    path = folder / MANIFEST
    write_text_atomic(path, json.dumps({"built_from": built_from, "files": files}, indent=1))
    return path


def verify_manifest(folder: Path) -> dict[str, Any]:
    """Check every file the manifest lists against its size and checksum; returns what it was built from."""
    manifest = read_json(folder / MANIFEST)
    try:
        files, built_from = manifest["files"], manifest["built_from"]
    except (KeyError, TypeError):
        raise damaged(folder / MANIFEST, "lacks its 'files' or 'built_from' section") from None
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise damaged(path, "is missing (listed in manifest.json)")
        if path.stat().st_size != want["bytes"] or file_sha256(path) != want["sha256"]:
            raise damaged(path, "does not match its checksum in manifest.json: it was changed or damaged after it "
                                "was written")
    return built_from


@dataclasses.dataclass(frozen=True)
class DataManifest:
    """What ``prepare`` made (``data/manifest.json``): the splits' content fingerprints, the held-out prompts'
    sha256, and the tokenizer and target that made them. ``prepare`` writes it; ``train`` checks the run folder
    against it before any work, so a split changed by hand, left from other data or tokenised with another
    tokenizer is refused, naming the file."""

    train: str
    validation: str | None
    validation_prompts: str | None
    tokenizer: str | None
    target: str
    NOT_RECORDED: ClassVar[str] = "not recorded"  # manifests older than the prompts' fingerprint

    def write(self, run: RunFolder) -> None:
        write_text_atomic(run.data_manifest, json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, run: RunFolder) -> "DataManifest":
        raw = read_json(run.data_manifest)
        if not isinstance(raw, dict) or not isinstance(raw.get("train"), str):
            raise damaged(run.data_manifest, "does not hold the train split's fingerprint")
        # what a manifest does not record is absent: no validation split, no tokenizer, prompts not recorded
        return cls(train=raw["train"], validation=raw.get("validation"), tokenizer=raw.get("tokenizer"),
                   validation_prompts=raw.get("validation_prompts", cls.NOT_RECORDED), target=raw.get("target", ""))

    def check(self, current: "DataManifest", run: RunFolder) -> None:
        """Refuse ``current`` (what the run folder holds now) where it is not what this manifest recorded."""
        if current.train != self.train:
            raise damaged(run.train_split, f"does not hash to the fingerprint prepare recorded in {run.data_manifest}"
                                           " (it was changed after prepare wrote it)")
        if current.tokenizer is not None and current.tokenizer != self.tokenizer:
            raise DrafttrainError(f"{run.train_split} was tokenised with another tokenizer than the target's "
                                  f"({current.target}): rerun `drafttrain prepare` with this recipe")
        if current.validation != self.validation:
            raise damaged(run.validation_split, f"is not the validation split prepare recorded in "
                                                f"{run.data_manifest} (changed, added or left from another prepare)")
        if self.validation_prompts != self.NOT_RECORDED and current.validation_prompts != self.validation_prompts:
            raise damaged(run.validation_prompts, f"is not the file prepare recorded in {run.data_manifest}")

