"""``drafttrain push``: an export folder to the Hugging Face Hub (huggingface_hub's create_repo + upload_folder).

The folder is checked against its manifest first, so a file changed or damaged since the export is never
uploaded, and its card must be there. The token is huggingface_hub's (HF_TOKEN or ``hf auth login``); it is
never printed or logged.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from drafttrain import DrafttrainError
from drafttrain.runfolder import MANIFEST, read_json, verify_manifest

CARD = "README.md"


def is_export(folder: Path) -> bool:
    """Whether ``folder`` is what ``drafttrain export`` wrote (its manifest names the format), unchecked."""
    return (folder / MANIFEST).is_file() and "format" in (read_json(folder / MANIFEST).get("built_from") or {})


def check_export(folder: str | Path) -> dict:
    """What the export was built from, after checking every file against its manifest."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file() or not (folder / CARD).is_file():
        raise DrafttrainError(f"{folder} is not a drafttrain export (no {MANIFEST} or {CARD}): run `drafttrain "
                              "export RUN --format ... --out DIR` and push DIR")
    built_from = verify_manifest(folder)
    if "format" not in built_from:
        raise DrafttrainError(f"{folder} is a checkpoint, not an export: run `drafttrain export` first")
    return built_from


def export_files(folder: Path) -> list[tuple[str, int]]:
    return [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()]


def check_repo_id(repo_id: str) -> None:
    """A Hub model repo id (NAME or OWNER/NAME, Hub characters), checked before any export or upload."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise DrafttrainError(f"--repo {repo_id!r} is not a Hub repo id: {str(err).splitlines()[0]}") from None


def push_export(folder: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
                message: str | None = None, built_from: dict | None = None) -> str:
    """Create the repo if needed (and the branch ``revision``) and upload the folder in one commit; returns the
    commit URL. A rerun after an interruption uploads again; LFS files already on the Hub are not sent twice.
    ``built_from``: what ``check_export`` returned, when the caller checked the folder already."""
    folder = Path(folder)
    built_from = built_from if built_from is not None else check_export(folder)
    check_repo_id(repo_id)
    if get_token() is None:
        raise DrafttrainError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (nothing was uploaded)")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, revision=revision, repo_type="model",
            commit_message=message or f"drafttrain export ({built_from['format']}, {built_from.get('kind')})",
        )
    except HfHubHTTPError as err:  # the server's reason, never the request headers (they hold the token)
        status = getattr(err.response, "status_code", None)
        hint = " (check HF_TOKEN or `hf auth login`, and write access to the repo)" if status in (401, 403) else ""
        raise DrafttrainError(f"pushing to {repo_id} failed: HTTP {status}: {str(err).splitlines()[0]}{hint}") from None
    except Exception as err:  # the network or the client (offline, DNS, timeouts): named, never a traceback
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DrafttrainError(f"pushing to {repo_id} failed: {type(err).__name__}: {reason} (is the Hub reachable "
                              "from here? HF_ENDPOINT names another server)") from None
    return str(commit.commit_url if hasattr(commit, "commit_url") else commit)
