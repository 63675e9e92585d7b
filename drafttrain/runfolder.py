"""The run folder: every file a run writes, named in one place, and how files are written (atomically).

Layout of ``<output_dir>/`` (``RunFolder``)::

    regenerated.jsonl (+ .settings.json, .dropped.jsonl)   the target's answers      prepare
    data/train, data/validation                          tokenised splits (Arrow)    prepare
    data/validation_prompts.jsonl                        held-out first turns        prepare
    data/manifest.json                                   what the splits were built from  prepare
    draft_vocab.safetensors                              d2t / t2d                   prepare
    features/, features/validation/                      offline target outputs      prepare
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
    .drafttrain-run                                      drafttrain made this folder (RUN_MARKER)  prepare, train
    .drafttrain-lock                                     which process works in it now (RunLock)  prepare, train, export
    .drafttrain-watch-lock                               which watcher measures its checkpoints   watch

drafttrain writes and deletes only in folders it made: ``RunFolder.claim`` refuses an output_dir that is not one
(the home folder, a source tree, a folder holding the recipe's data) before anything is written, and every
deletion goes through drafttrain.userfiles.remove, which checks the same marker. One process works in a run folder
at a time (``RunLock``).

A checkpoint folder named ``step-N`` is always complete: it is written as ``step-N.tmp`` and renamed once every
file is on disk (see drafttrain.training.checkpoint).

Reading: every reader of a run-folder file goes through the functions below, which turn a decode error (JSON,
safetensors, Arrow) or a checksum mismatch into a DrafttrainError that names the file, the stage that wrote it and
how to recover, instead of a raw traceback.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, ClassVar

from drafttrain import DrafttrainError, __version__
from drafttrain.userfiles import make_folder, remove, writing

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
RUN_MARKER = ".drafttrain-run"  # written into a run folder when drafttrain makes it (or takes up an earlier one)
LOCK_FILE = ".drafttrain-lock"  # RunLock's: the pid and start time of the process working in the run now
WATCH_LOCK_FILE = ".drafttrain-watch-lock"  # the same for `drafttrain watch`, which works beside a trainer
_STEP_DIR = re.compile(r"^step-(\d+)$")
# What earlier drafttrain versions wrote into a run folder (before RUN_MARKER): such a folder is taken up, not refused
# (regenerate's settings: a prepare stopped while the target answered, which a rerun resumes)
_EARLIER_RUN_FILES = ("prepare_summary.json", "data/manifest.json", "regenerated.settings.json")


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
    def held_out_features(self) -> Path:
        """The offline cache of the validation split: the held-out accuracy at each checkpoint reads it."""
        return self.features / "validation"

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

    # -- what drafttrain made -------------------------------------------------------------------------------------
    @property
    def replaced_by_prepare(self) -> tuple[Path, ...]:
        """What ``drafttrain prepare`` deletes and writes anew in a run folder it reruns in."""
        return self.train_split, self.validation_split, self.validation_prompts, self.draft_vocab, self.features

    @staticmethod
    def made(folder: Path) -> bool:
        """Whether ``folder`` carries drafttrain's run marker (userfiles.remove asks this of a run's files)."""
        return (folder / RUN_MARKER).is_file()

    def earlier_run(self) -> bool:
        """A run folder an earlier drafttrain wrote, before it marked them: its own files are there."""
        return any((self.root / name).is_file() for name in _EARLIER_RUN_FILES) or \
            bool(complete_checkpoints(self.checkpoints))

    def claim(self, reads: Iterable[tuple[str, Path]] = ()) -> None:
        """Make the run folder (marked as drafttrain's), or take up one drafttrain made, before anything is written
        or deleted in it. Refused, naming the folder and why: the root or home folder, a folder holding a file
        ``reads`` names (what the recipe reads: (its key, its path)) where prepare would replace it, a source tree,
        any other folder that holds files drafttrain did not write. An unmarked run folder of an earlier drafttrain
        is marked and used."""
        refusal = self._refusal(tuple(reads))
        if refusal is not None:
            raise DrafttrainError(f"output_dir {self.root.resolve()} {refusal}: drafttrain writes and deletes only "
                                  "in a run folder it made; choose a new or empty folder for output_dir")
        if self.root.is_dir() and any(self.root.iterdir()) and not self.made(self.root):
            logging.getLogger(__name__).warning("taking up %s, a run folder an earlier drafttrain wrote (marking it "
                                                "with %s)", self.root, RUN_MARKER)
        make_folder(self.root, "the run folder (output_dir)")  # a read-only or misplaced output_dir: one line
        if self.made(self.root):
            return
        with writing(self.root / RUN_MARKER, "the run folder's marker"):
            record = {"made_by": "drafttrain", "version": __version__, "created": _now()}
            write_text_atomic(self.root / RUN_MARKER, json.dumps(record) + "\n")

    def _refusal(self, reads: tuple[tuple[str, Path], ...]) -> str | None:
        root = self.root.resolve()
        for key, path in reads:
            path = path.expanduser().resolve()
            if any(path.is_relative_to(p.resolve()) for p in self.replaced_by_prepare):
                return f"holds {key} ({path}), which this recipe reads and prepare would replace"
        home = Path.home().resolve()
        if home.is_relative_to(root):
            return "is your home folder" if home == root else f"holds your home folder ({home})"
        if self.made(root) or not root.is_dir() or not any(root.iterdir()):
            return None
        inside = [f"{key} ({path})" for key, path in reads if path.expanduser().resolve().is_relative_to(root)]
        if inside:
            return f"holds {inside[0]}, which this recipe reads"
        if (root / ".git").exists():
            return "is a source tree (it holds .git)"
        if self.earlier_run():
            return None
        names = sorted(p.name for p in root.iterdir())
        return f"holds files drafttrain did not write ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

    def remove(self, path: Path, why: str) -> None:
        """Delete a file or folder of this run (userfiles.remove: refused unless the run folder is drafttrain's)."""
        remove(path, why, inside=self.root, made=self.made)

    @classmethod
    def holding(cls, path: str | Path) -> "RunFolder | None":
        """The run folder drafttrain made that ``path`` lies in (the nearest), or None."""
        for folder in Path(path).expanduser().resolve().parents:
            if cls.made(folder):
                return cls(folder)
        return None


def exported_or_imported(folder: Path) -> bool:
    """Whether ``folder`` is a draft folder ``drafttrain export`` or ``drafttrain import`` wrote: its manifest names
    the format it was written in, or the foreign folder it was imported from (a checkpoint's names neither)."""
    try:
        built_from = read_json(folder / MANIFEST).get("built_from") or {}
    except (DrafttrainError, AttributeError):
        return False
    return isinstance(built_from, dict) and bool({"format", "imported"} & set(built_from))


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")


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


def write_atomic(path: Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` writes the file under a temporary name, renamed to ``path`` once whole (a plot, a library's
    file): a full disk or a kill never leaves a half file under the final name."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except BaseException:
        remove(tmp, "the half-written file of this failed write")
        raise
    os.replace(tmp, path)
    return path


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
    return read_json_file(path)[0]


def read_json_file(path: str | Path) -> tuple[Any, FileDigest]:
    """A JSON file read once: its value, and the size and sha256 of the bytes it was read from (what a manifest's
    check compares without reading the file again)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        return json.loads(raw.decode()), FileDigest(len(raw), hashlib.sha256(raw).hexdigest())
    except FileNotFoundError:
        raise damaged(path, "is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise damaged(path, f"is not valid JSON ({_first_line(err)})") from None


@dataclasses.dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


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
        if name not in (MANIFEST, RUN_MARKER, LOCK_FILE) and name not in skip:
            files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    path = folder / MANIFEST
    write_text_atomic(path, json.dumps({"built_from": built_from, "files": files}, indent=1))
    return path


def verify_manifest(folder: Path, known: dict[str, FileDigest] | None = None) -> dict[str, Any]:
    """Check every file the manifest lists against its size and checksum; returns what it was built from. ``known``:
    files the caller has read already, by the digest of the bytes it read (they are not read again)."""
    manifest, known = read_json(folder / MANIFEST), known or {}
    try:
        files, built_from = manifest["files"], manifest["built_from"]
    except (KeyError, TypeError):
        raise damaged(folder / MANIFEST, "lacks its 'files' or 'built_from' section") from None
    for name, want in files.items():
        path = folder / name
        if name in known:
            if known[name] != FileDigest(want["bytes"], want["sha256"]):
                raise damaged(path, "does not match its checksum in manifest.json: it was changed or damaged after "
                                    "it was written")
            continue
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


# ------------------------------------------------------------------------------------------------ one process at a time


class RunLock:
    """One drafttrain process works in a run folder at a time (prepare, train, an export into it; a watcher).

    The lock is an exclusive ``flock`` on ``.drafttrain-lock``, which holds the holder's pid, host, command and start
    time: a second process is refused naming them. The kernel drops the lock when its process ends however it ends,
    so a record left in the file by a process killed with SIGKILL is recognised as stale and taken over, with a
    warning naming it. Re-entrant within a process. In a launch (``accelerate launch``: RANK is set) the first
    process, rank 0, holds it for all of them: the others take nothing and would not refuse each other."""

    _held: ClassVar[dict[Path, int]] = {}  # lock file -> depth, this process's locks
    _files: ClassVar[dict[Path, int]] = {}  # lock file -> its descriptor

    def __init__(self, root: str | Path, command: str, name: str = LOCK_FILE):
        # ``name``: another lock file, for a process that works beside the one holding the run's (a watcher)
        self.root, self.command, self.name = Path(root).expanduser(), command, name

    @property
    def path(self) -> Path:
        return self.root / self.name

    def __enter__(self) -> "RunLock":
        if not first_of_launch():  # a launch's other ranks: rank 0 holds it for them
            return self
        key = self.path.resolve()
        if key not in self._held:
            self._files[key] = self._acquire()
        self._held[key] = self._held.get(key, 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        if not first_of_launch():
            return
        key = self.path.resolve()
        self._held[key] -= 1
        if self._held[key] == 0:
            del self._held[key]
            fd = self._files.pop(key)
            os.ftruncate(fd, 0)  # released: no record left (a record with no lock is a killed holder's)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _acquire(self) -> int:
        with writing(self.path, "the run folder's lock file"):  # a read-only run folder: one line
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_record(fd, wait=True)
            os.close(fd)
            raise DrafttrainError(f"{self.root} is in use by another drafttrain process ({_describe(holder)}): wait "
                                  "for it to end, or use another output_dir") from None
        except OSError:
            os.close(fd)
            raise
        left = _lock_record(fd, wait=False)
        if left:  # the lock was free but a record stayed: its holder ended without releasing it (SIGKILL, a crash)
            logging.getLogger(__name__).warning(
                "taking over the lock of %s left by %s, which ended without releasing it (killed?)", self.root,
                _describe(left))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        return fd


def first_of_launch() -> bool:
    """Whether this process runs alone or is the first of a launch (torchrun and accelerate set RANK for each)."""
    return os.environ.get("RANK", "0") == "0"


def _lock_record(fd: int, wait: bool) -> dict[str, Any]:
    """The record in a lock file ({} when there is none). ``wait``: its holder may be writing it just now."""
    for _ in range(20 if wait else 1):
        try:
            return json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # empty or half written
            time.sleep(0.05 if wait else 0)
    return {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "pid unknown"
    host = f" on {holder['host']}" if holder.get("host") not in (None, socket.gethostname()) else ""
    return f"pid {holder.get('pid')}{host}, `{holder.get('command')}`, started {holder.get('started')}"
