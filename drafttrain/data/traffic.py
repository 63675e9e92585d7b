"""Served traffic as prompts: OpenAI-format request logs (chat completions JSONL, as a gateway or vLLM's request
logging writes them).

Each line is one logged request, in any of the shapes those writers use: the request itself (``{"messages": [...],
"tools": [...]}``), a request beside its response (``{"request": {...}, "response": {...}}``), or an OpenAI batch
line (``{"custom_id": ..., "body": {...}}``). The prompt is the request's messages (system prompt and tools kept)
up to its last user turn; a logged answer after it is not part of the prompt. A line that is not JSON or holds no
usable request is skipped and named (line number and why), never silently; a request seen twice is kept once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.data.conversations import FormatMismatch, SkipRecord, normalize_record

REQUEST_KEYS = ("request", "body")  # where a logged line nests the request, when it does


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as a server is sent it: the messages (ending with a user turn) and the tools offered."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None


@dataclasses.dataclass
class RequestLog:
    prompts: list[Prompt]
    skipped: list[str]  # "line N: why", one per line left out
    duplicates: int


def read_request_log(path: str | Path) -> RequestLog:
    """Every distinct prompt of a request log, in file order, with the lines it could not use and why."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DrafttrainError(f"request log not found: {path}")
    prompts, skipped, seen, duplicates = [], [], set(), 0
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = _prompt_of(json.loads(line), f"{path.name}:{number}")
        except json.JSONDecodeError as err:
            skipped.append(f"line {number}: not JSON ({err.msg})")
            continue
        except (SkipRecord, FormatMismatch) as err:
            skipped.append(f"line {number}: {err}")
            continue
        # every message counts here, system prompts and tools included: the same question under another system
        # prompt is another request to the server
        key = json.dumps([prompt.messages, prompt.tools], sort_keys=True, default=str)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        prompts.append(prompt)
    if not prompts:
        raise DrafttrainError(f"request log {path} holds no usable request"
                              + (f" ({len(skipped)} lines skipped; first: {skipped[0]})" if skipped else ""))
    return RequestLog(prompts, skipped, duplicates)


def _prompt_of(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise SkipRecord(f"a {type(record).__name__}, not an object")
    request = next((record[k] for k in REQUEST_KEYS if isinstance(record.get(k), dict)), record)
    if "messages" not in request:
        raise SkipRecord("no messages (not a chat completions request)")
    conversation = normalize_record({"messages": request["messages"], "tools": request.get("tools")}, "openai",
                                    where, "request-log")[0]
    messages = conversation["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    tools = conversation.get("tools")
    return Prompt(tuple(messages[: last_user + 1]), tuple(tools) if tools else None)
