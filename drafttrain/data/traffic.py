"""Served traffic as data: OpenAI-format request logs (chat completions JSONL, as an API gateway logs them) and
plain prompt files.

Each line of a request log is one logged request, in any of these shapes: the request itself
(``{"messages": [...], "tools": [...]}``), a request beside its response (``{"request": {...}, "response": {...}}``,
the response's body possibly under ``response.body``), or an OpenAI batch input line (``{"custom_id": ...,
"body": {...}}``; a batch *output* line holds no request and is skipped as such). The prompt is
the request's messages (system prompt and tools kept) up to its last user turn; the logged answer, when there is
one, is kept beside it with the model that wrote it, so that ``prepare`` keeps the target's own answers and has the
target answer the rest. A line that is not JSON or holds no usable request is skipped and named (line number and
why), never silently; a request seen twice is kept once.

A line written by ``drafttrain eval --feedback`` (drafttrain.evaluation.feedback) also carries, under
``drafttrain_feedback``, the token ids the target emitted for the answer, the indices where it replaced draft tokens
it refused, and whether the answer ended (a stop token) or was cut at the evaluation's token limit; a cut answer is
kept for such a line (its end-of-turn marker is then not trained, drafttrain.data.tokenize). The source's
``rejected_weight`` becomes those positions' loss weight.

A prompts file holds one prompt per line (``.txt``), or JSON lines of strings or ``{"prompt": ...}``.

Secrets: every string of a request (messages, tool calls, tool definitions) and of its answer is scanned for what
looks like a credential (API keys of the common providers, bearer tokens, JWTs, private key blocks, passwords in
URLs or assignments) and each match is replaced by ``[REDACTED]`` as the line is read, before anything is stored
or tokenised; the counts by kind are reported.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.data.conversations import FormatMismatch, LoadedSource, SkipRecord, normalize_record
from drafttrain.userfiles import read_text

REQUEST_KEYS = ("request", "body")  # where a logged line nests the request, when it does
REDACTED = "[REDACTED]"
FEEDBACK_KEY = "drafttrain_feedback"  # what `drafttrain eval --feedback` adds to a request-log line
ANSWER_WEIGHTS = "answer_weights"  # the conversation key that carries it on to tokenisation

# What credentials look like, by kind. A pattern's group ``s``, where it has one, is the secret (the rest, a key's
# name or a scheme, is kept); without it the whole match is. An assignment's value counts only when it is quoted or
# looks like a token (it has a digit and ends where the value does): ``password = input(...)`` or "Secret: Remember"
# are code and prose, not secrets.
_KEY_NAME = r"\b[\w-]*(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|access[_-]?token|auth[_-]?token)[\w-]*"
SECRET_PATTERNS: dict[str, re.Pattern] = {
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY[A-Z ]*-----.*?"
                              r"(?:-----END [A-Z ]*PRIVATE KEY[A-Z ]*-----|\Z)", re.S),
    "jwt": re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    "api key": re.compile(
        r"\b(?:sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}|sk_(?:live|test)_[A-Za-z0-9]{16,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
        r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|xox[abprs]-[A-Za-z0-9-]{10,}"
        r"|AIza[0-9A-Za-z_-]{35}|hf_[A-Za-z0-9]{30,}|glpat-[A-Za-z0-9_-]{20,})"),
    "authorization header": re.compile(r"\b(?:[Bb]earer|[Bb]asic)\s+(?P<s>[A-Za-z0-9._~+/=-]{16,})"),
    "url password": re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]*:(?P<s>[^@\s/]+)@"),
    "password": re.compile(_KEY_NAME + r"[\"']?\s*[:=]\s*(?P<q>[\"'])(?P<s>(?!\[REDACTED\])[^\"'\s]{6,})(?P=q)", re.I),
    "password value": re.compile(_KEY_NAME + r"[\"']?\s*[:=]\s*(?P<s>(?=[^\s\"',;]*\d)[A-Za-z0-9_\-+/=!@#$%^&*~]{6,})"
                                 r"(?![^\s\"',;])", re.I),
    # prose: "my password is Tr0ub4dor&3", "the AWS secret access key is wJal...", "api key for prod: x9..."; the value
    # counts when it has a digit or a symbol, or is one long run of letters ("the password is required" is prose)
    "password phrase": re.compile(
        r"\b(?:pass(?:word|phrase|wd|code)|pwd|pin|secret(?:\s+access)?(?:\s+key)?|private\s+key|(?:api|access|"
        r"auth(?:entication)?|bearer|refresh|session)\s*[_-]?\s*(?:key|token)|credentials?)\b"
        r"(?:\s+(?:for|to|of|on)\s+[\w.@-]+)?\s+(?:is|was|are)\s*:?\s*[\"'`]?"
        r"(?P<s>(?=[^\s\"'`,;]*[\d!@#$%^&*+=/_-])[^\s\"'`,;]{5,}[^\s\"'`,;.!?:)]|[A-Za-z]{16,})", re.I),
}


def _replaced(match: re.Match) -> str:
    if "s" not in match.re.groupindex:
        return REDACTED
    start, end = match.start("s") - match.start(), match.end("s") - match.start()
    return match.group(0)[:start] + REDACTED + match.group(0)[end:]


def redact(text: str, found: Counter) -> str:
    """``text`` with every secret-looking string replaced (counted in ``found`` by kind)."""
    for kind, pattern in SECRET_PATTERNS.items():
        text, n = pattern.subn(_replaced, text)
        found[kind.removesuffix(" value").removesuffix(" phrase")] += n
    return text


def redacted(value: Any, found: Counter | None = None) -> Any:
    """A JSON-like value (strings, lists, dicts) with every secret-looking string replaced: a request, or a recipe
    before it is written into a file that leaves the machine (a model card, a manifest, a summary)."""
    found = Counter() if found is None else found
    if isinstance(value, str):
        return redact(value, found)
    if isinstance(value, list):
        return [redacted(v, found) for v in value]
    if isinstance(value, dict):  # keys too: a key used as a JSON object's key is still a key
        return {(redact(k, found) if isinstance(k, str) else k): redacted(v, found) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as a server is sent it: the messages (ending with a user turn) and the tools offered; with the
    logged answer (an assistant message) and the model that gave it, where the log has them."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    answer: dict | None = None
    answered_by: str | None = None
    feedback: dict | None = None  # the answer's token ids and rejected positions (FEEDBACK_KEY), when logged


@dataclasses.dataclass
class RequestLog:
    prompts: list[Prompt]
    skipped: list[str]  # "line N: why", one per line left out
    duplicates: int
    redacted: Counter = dataclasses.field(default_factory=Counter)  # secrets replaced, by kind


def read_request_log(path: str | Path) -> RequestLog:
    """Every distinct prompt of a request log, in file order, with the lines it could not use and why."""
    path = _existing(path, "request log")
    prompts, skipped, found = [], [], Counter()
    for number, line in enumerate(read_text(path, "request log").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = _prompt_of(redacted(json.loads(line), found), f"{path.name}:{number}")
        except json.JSONDecodeError as err:
            skipped.append(f"line {number}: not JSON ({err.msg})")
            continue
        except (SkipRecord, FormatMismatch) as err:
            skipped.append(f"line {number}: {err}")
            continue
        prompts.append(prompt)
    return _distinct(prompts, skipped, found, f"request log {path} holds no usable request")


def read_prompts_file(path: str | Path) -> RequestLog:
    """A prompts file (see the module docstring) as user prompts, each once."""
    path = _existing(path, "prompts file")
    prompts, skipped, found = [], [], Counter()
    for number, line in enumerate(read_text(path, "prompts file").splitlines(), 1):
        text = line.strip()
        if path.suffix.lower() != ".txt" and text:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                skipped.append(f"line {number}: not JSON ({err.msg})")
                continue
            text = value.get("prompt") if isinstance(value, dict) else value
            if not isinstance(text, str):
                skipped.append(f"line {number}: neither a string nor an object with a 'prompt' string")
                continue
        if not text.strip():
            continue
        prompts.append(Prompt(({"role": "user", "content": redact(text, found)},)))
    return _distinct(prompts, skipped, found, f"prompts file {path} holds no prompt")


def _distinct(prompts: list[Prompt], skipped: list[str], found: Counter, empty: str) -> RequestLog:
    """The prompts read, each once in file order (the first copy kept), or an error saying ``empty`` and why."""
    kept, seen = [], set()
    for prompt in prompts:
        # every message counts, system prompts and tools included: the same question under another system prompt
        # is another request to the server
        key = json.dumps([prompt.messages, prompt.tools], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            kept.append(prompt)
    if not kept:
        raise DrafttrainError(empty + (f" ({len(skipped)} lines skipped; first: {skipped[0]})" if skipped else ""))
    return RequestLog(kept, skipped, len(prompts) - len(kept), +found)


def traffic_source(path: str, fmt: str, name: str, rejected_weight: int = 1) -> tuple[LoadedSource, RequestLog]:
    """A request log or prompts file (``fmt``) as a data source: one conversation per distinct prompt, with the
    logged answer where there is one (``answered_by`` records its model); skipped lines and duplicates counted.
    An answer with evaluation feedback carries its token ids and ``rejected_weight`` on to tokenisation."""
    read = read_request_log(path) if fmt == "request_log" else read_prompts_file(path)
    conversations = []
    for i, prompt in enumerate(read.prompts):
        messages = [dict(m) for m in prompt.messages] + ([dict(prompt.answer)] if prompt.answer else [])
        conversation = {"id": f"{name}:{i}", "source": name, "messages": messages,
                        "needs_response": prompt.answer is None}
        if prompt.tools:
            conversation["tools"] = list(prompt.tools)
        if prompt.answered_by:
            conversation["answered_by"] = prompt.answered_by
        if prompt.feedback:  # only an answer's (_prompt_of)
            conversation[ANSWER_WEIGHTS] = dict(prompt.feedback, rejected_weight=rejected_weight)
        conversations.append(conversation)
    skipped = Counter(reason.partition(": ")[2].split(" (")[0] for reason in read.skipped)
    if read.duplicates:
        skipped["duplicate request"] = read.duplicates
    records = len(read.prompts) + len(read.skipped) + read.duplicates
    return LoadedSource(name=name, path=str(path), conversations=conversations, records=records,
                        skipped=skipped), read


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DrafttrainError(f"{what} not found: {path}")
    return path


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
    # the logged answer replies to the whole request: it is kept only when the prompt is all of it (after a tool
    # result or an assistant prefill it answers turns the prompt leaves out)
    feedback = _feedback_of(record)
    answer, model = _logged_answer(record, feedback) if last_user == len(messages) - 1 else (None, None)
    return Prompt(tuple(messages[: last_user + 1]), tuple(tools) if tools else None, answer, model,
                  feedback if answer is not None else None)


def _feedback_of(record: dict) -> dict | None:
    """The evaluation feedback of a line (FEEDBACK_KEY), checked; None when the line has none."""
    payload = record.get(FEEDBACK_KEY)
    if payload is None:
        return None
    ids = payload.get("answer_ids") if isinstance(payload, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        raise SkipRecord(f"{FEEDBACK_KEY}: answer_ids is not a non-empty list of token ids")
    rejected = payload.get("rejected_at")
    if not isinstance(rejected, list) or not all(type(i) is int and 0 < i < len(ids) for i in rejected):
        raise SkipRecord(f"{FEEDBACK_KEY}: rejected_at is not a list of indices into answer_ids (the first token, "
                         "the prefill's, is never one)")
    if not isinstance(payload.get("complete"), bool):
        raise SkipRecord(f"{FEEDBACK_KEY}: complete is not true or false")
    return {"answer_ids": ids, "rejected_at": sorted(set(rejected)), "complete": payload["complete"]}


def _logged_answer(record: dict, feedback: dict | None = None) -> tuple[dict | None, str | None]:
    """The first choice's assistant message of the logged response (beside the request, or an OpenAI batch
    output's ``response.body``) and the model that wrote it; (None, None) when the line has none. An answer cut
    at a token limit is kept only with ``feedback``, whose token ids say where it was cut."""
    response = record.get("response")
    if isinstance(response, dict) and isinstance(response.get("body"), dict):
        response = response["body"]
    choices = response.get("choices") if isinstance(response, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    ended = (None, "stop", "tool_calls") + (("length",) if feedback is not None else ())
    if not isinstance(message, dict) or first.get("finish_reason") not in ended:
        return None, None  # no answer, or one cut short (length, content filter): the target answers instead
    try:
        answer = normalize_record({"messages": [{"role": "user", "content": "."}, {**message, "role": "assistant"}]},
                                  "openai", "answer", "request-log")[0]["messages"][-1]
    except (SkipRecord, FormatMismatch):
        return None, None
    if answer["role"] != "assistant":
        return None, None
    return answer, str(response.get("model")) if response.get("model") else None
