"""The resumable output of a regeneration: the rows file (one finished conversation per line, appended with flush
and fsync), its settings sidecar (compared on every rerun, so two distributions are never mixed), its dropped-ids
sidecar, and the per-row seeds and hashes that make a resumed run reproduce an uninterrupted one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.runfolder import write_text_atomic

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RegenerationSettings:
    """What decides the generated answers; stored beside the output and compared on every rerun."""

    target: str
    backend: str
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    # Hash of the chat template the prompts were rendered with (hf backend; the server's own for openai: None).
    chat_template: str | None = None

    @classmethod
    def from_config(
        cls, cfg: RegenerateConfig, target_name: str, seed: int, tokenizer=None
    ) -> "RegenerationSettings":
        model = (cfg.served_model or target_name) if cfg.backend == "openai" else target_name
        return cls(
            target=model,
            backend=cfg.backend,
            temperature=float(cfg.temperature),
            # top_p has no effect in greedy decoding; normalise it so a greedy rerun does not trip the check.
            top_p=float(cfg.top_p) if cfg.temperature > 0 else 1.0,
            max_new_tokens=int(cfg.max_new_tokens),
            seed=int(seed),
            chat_template=template_hash(tokenizer) if cfg.backend == "hf" and tokenizer is not None else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def template_hash(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_seed(seed: int, conversation_id: str, turn: int) -> int:
    """A 63-bit seed that depends only on (recipe seed, id, answer slot): stable across batching and resumes."""
    digest = hashlib.sha256(f"{seed}|{conversation_id}|{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def prompt_hash(conversation: dict) -> str:
    """Hash of what the output row was derived from: a changed source row with a reused id is detected."""
    payload = json.dumps(
        {"messages": conversation.get("messages"), "tools": conversation.get("tools")},
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class OutputPaths:
    rows: Path
    settings: Path
    dropped: Path

    @classmethod
    def for_output(cls, path: str | Path) -> "OutputPaths":
        path = Path(path)
        stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
        return cls(
            rows=path,
            settings=path.with_name(stem + ".settings.json"),
            dropped=path.with_name(stem + ".dropped.jsonl"),
        )


def read_jsonl_resumable(path: Path) -> list[dict]:
    """Read the rows written so far; cut off a truncated last line (a kill mid-write) so appending can go on.

    Only the last line may be damaged: rows are appended one at a time with fsync, so a broken line anywhere
    else means the file was edited or corrupted, and that is an error rather than something to guess around.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # a tail without its newline is a row whose write was cut: never complete
    lines = data[:keep].split(b"\n")[:-1]
    rows: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if number < len(lines):
                raise DrafttrainError(f"{path}: line {number} is not valid JSON ({err}); the file is corrupt") from None
            keep -= len(line) + 1  # the last complete line is damaged too: redo that row as well
            break
        rows.append(row)
    if keep < len(data):
        log.warning("%s: cutting a truncated last line (%d bytes); that row will be redone", path, len(data) - keep)
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return rows


def append_jsonl(handle, row: dict) -> None:
    """Append one row durably: after this returns, a kill cannot lose it."""
    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def check_settings(paths: OutputPaths, settings: RegenerationSettings, has_rows: bool) -> None:
    """Refuse to append to a file generated with other settings; record the settings for a new file."""
    wanted = settings.as_dict()
    if paths.settings.is_file():
        try:
            recorded = json.loads(paths.settings.read_text())
        except ValueError:
            raise DrafttrainError(f"{paths.settings} is not valid JSON; delete it together with {paths.rows}") from None
        if recorded != wanted and has_rows:
            changed = ", ".join(
                f"{key}: {recorded.get(key)!r} in the file, {wanted.get(key)!r} now"
                for key in sorted(set(recorded) | set(wanted))
                if recorded.get(key) != wanted.get(key)
            )
            raise DrafttrainError(
                f"{paths.rows} was generated with other settings ({changed}). Mixing answers from two settings "
                "would silently change the training distribution: use another output directory, restore the "
                "settings, or delete the file to regenerate from scratch."
            )
        if recorded == wanted:
            return
    elif has_rows:
        raise DrafttrainError(
            f"{paths.rows} has rows but no settings file ({paths.settings.name}), so it cannot be checked "
            "against the current settings; delete it or move it away"
        )
    write_text_atomic(paths.settings, json.dumps(wanted, indent=2) + "\n")
