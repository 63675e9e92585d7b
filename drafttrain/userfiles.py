"""The user's own files and folders: reading, writing and removing them goes through here, so that an OS or
decoding error becomes one line naming the path and the cause (a binary file, a read-only folder, a file where a
folder should be, a full disk, a file-size limit), never a traceback from deep inside a library, and so that
drafttrain deletes nothing it did not make (``remove``)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from drafttrain import DrafttrainError

log = logging.getLogger(__name__)

CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EFBIG: "the file grew past the size this process may write (a file-size limit: ulimit -f)",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ENOENT: "it does not exist",
    errno.EEXIST: "a file is there, not a folder",
    errno.ENOEXEC: "it is not a program this machine can run",
}


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # safetensors names the OS error inside its own message
# torch.save past the end of the room it had (a full disk, or a file-size limit) says only "unexpected pos"
_WRITE_CUT = "the file could not be written whole: no space left on the device, or a file-size limit (ulimit -f)"


def _errno_of(err: BaseException) -> int | None:
    if isinstance(err, OSError):
        return err.errno
    match = _RUST_OS_ERROR.search(str(err))
    return int(match.group(1)) if match else None


def cause(err: BaseException) -> str:
    """A few words for why an OS call failed (or what a library said, when it hides the OS error)."""
    number = _errno_of(err)
    if number in CAUSES:
        return CAUSES[number]
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    text = str(err)
    if "No space left" in text:
        return CAUSES[errno.ENOSPC]
    if "unexpected pos" in text:
        return _WRITE_CUT
    return (text.splitlines() or [type(err).__name__])[0][:200]


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or the file-size limit) had no room for what was being written."""
    return cause(err) in (CAUSES[errno.ENOSPC], CAUSES[errno.EFBIG], CAUSES[errno.EDQUOT], _WRITE_CUT)


def read_text(path: str | Path, what: str) -> str:
    """The text of the user's file ``path`` (UTF-8, a BOM allowed); ``what`` names it in the error."""
    path = Path(path).expanduser()
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise DrafttrainError(f"{what} {path} is not UTF-8 text (byte {err.start}: {err.reason}): give a text "
                              "file") from None
    except OSError as err:
        raise DrafttrainError(f"{what} {path} cannot be read: {cause(err)}") from None


@contextlib.contextmanager
def writing(path: str | Path, what: str, after: str = ""):
    """Run the block that writes ``path``; an OS error (or a library's disk-full error) in it becomes one line
    naming ``what``, the path and the cause, then ``after`` (what is intact, how to continue)."""
    try:
        yield
    except DrafttrainError:
        raise
    except Exception as err:  # noqa: BLE001 - libraries wrap the OS error in their own types (safetensors, torch)
        if not (_errno_of(err) in CAUSES or disk_full(err)):  # another failure (a bug) keeps its type and traceback
            raise
        raise DrafttrainError(f"cannot write {what} {path}: {cause(err)}{after}") from None


def make_folder(path: str | Path, what: str) -> Path:
    """``path`` as a folder (made with its parents when missing), or one line saying why it cannot be."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise DrafttrainError(f"cannot write {what} {path}: a file is there, not a folder")
    with writing(path, what):
        path.mkdir(parents=True, exist_ok=True)
        probe = path / WRITE_CHECK  # a folder that exists may still refuse files (read-only)
        probe.touch()
        remove(probe, "the write check it just made")
    return path


# ------------------------------------------------------------------------------------------------ removing

WRITE_CHECK = ".drafttrain-write-check"
# The names drafttrain gives its own scratch beside what it writes: NAME.tmp (being written), NAME.old (being
# deleted), NAME.partial (an export being built), .KEY.work-PID-HEX / .KEY.tmp-PID-HEX (a cache entry being built).
SCRATCH = re.compile(r"^(?:.+\.(?:tmp|old|partial)|\..+\.(?:work|tmp)-\d+-[0-9a-f]{8}|" + re.escape(WRITE_CHECK) + ")$")


def remove(path: str | Path, why: str, inside: Path | None = None,
           made: Callable[[Path], bool] | None = None) -> None:
    """The one place drafttrain deletes a file or a folder (tests/test_nothing_lost.py fails on any other delete).

    ``path`` goes only when drafttrain made it: it is ``inside``, or lies in it, and ``made(inside)`` recognises that
    folder as one drafttrain wrote (a run folder's marker, an export's manifest, a cache entry's record); or, given no
    ``inside``, it is scratch drafttrain names itself (SCRATCH). An empty folder holds nothing to lose. The root
    folder, the home folder and any folder holding the current one are never removed. Otherwise nothing is removed
    and the refusal names the path, what the removal was for (``why``) and why it is refused."""
    path = Path(path).expanduser()
    if not os.path.lexists(path):
        return
    real = path.parent.resolve() / path.name  # a link is removed as a link, never the folder it points to
    refusal = _not_removable(real, inside, made)
    if refusal is not None:
        raise DrafttrainError(f"drafttrain will not delete {path} ({why}): {refusal}; nothing was removed")
    log.debug("removing %s: %s", path, why)
    try:
        if real.is_dir() and not real.is_symlink():
            shutil.rmtree(real)
        else:
            os.unlink(real)
    except OSError as err:
        raise DrafttrainError(f"cannot remove {path} ({why}): {cause(err)}") from None


def _not_removable(real: Path, inside: Path | None, made: Callable[[Path], bool] | None) -> str | None:
    """Why ``real`` (its parent resolved) must stay, or None."""
    for place, name in ((Path.home(), "your home folder"), (Path.cwd(), "the current folder")):
        if place.resolve().is_relative_to(real):
            return f"it is or holds {name}"
    if real.is_dir() and not real.is_symlink() and not any(real.iterdir()):
        return None
    if inside is None:
        return None if SCRATCH.match(real.name) else "it is not scratch that drafttrain names and makes itself"
    owner = inside.expanduser().resolve()
    if not real.is_relative_to(owner):
        return f"it is not inside {inside}"
    if made is None or not made(owner):
        return f"{inside} is not a folder drafttrain made"
    return None
