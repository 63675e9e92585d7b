"""The user's own files and folders: reading and writing them goes through here, so that an OS or decoding error
becomes one line naming the path and the cause (a binary file, a read-only folder, a file where a folder should be,
a full disk), never a traceback from deep inside a library."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from drafttrain import DrafttrainError

CAUSES = {
    errno.ENOSPC: "no space left on the device",
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


def cause(err: BaseException) -> str:
    """A few words for why an OS call failed (or what a library said, when it hides the OS error)."""
    if isinstance(err, OSError) and err.errno in CAUSES:
        return CAUSES[err.errno]
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    text = str(err)
    if "No space left" in text or "unexpected pos" in text:  # torch.save and safetensors on a full disk
        return CAUSES[errno.ENOSPC]
    return (text.splitlines() or [type(err).__name__])[0][:200]


def disk_full(err: BaseException) -> bool:
    return cause(err) == CAUSES[errno.ENOSPC]


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
    except (OSError, RuntimeError, ValueError) as err:
        known = err.errno in CAUSES if isinstance(err, OSError) else False
        if not (known or disk_full(err)):  # another failure (a crash, a bug) keeps its own type and traceback
            raise
        raise DrafttrainError(f"cannot write {what} {path}: {cause(err)}{after}") from None


def make_folder(path: str | Path, what: str) -> Path:
    """``path`` as a folder (made with its parents when missing), or one line saying why it cannot be."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise DrafttrainError(f"cannot write {what} {path}: a file is there, not a folder")
    with writing(path, what):
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".drafttrain-write-check"  # a folder that exists may still refuse files (read-only)
        probe.touch()
        probe.unlink()
    return path
