"""One conversation schema for every data source.

A conversation is a plain dict::

    {"id": "gsm8k_train:17", "source": "gsm8k_train", "needs_response": False,
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str,
                   "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}]},  # optional
                  ...],
     "tools": str | list}  # optional, as given by the dataset (glaive keeps a JSON string)

``needs_response`` marks prompt-only conversations (no assistant turn at all, e.g. FastChat question files or an
Alpaca row with an empty output). Their ``messages`` hold only the system/user turns, possibly several user turns in
a row (MT-Bench has two): the regenerator answers each user turn in order. Tokenisation skips them (counted).

Formats (auto-detected per record from its keys, or forced per source):
  sharegpt       ``conversations``/``messages`` of ``{from, value}``; top-level ``system`` and ``tools`` kept.
                 ``function_call`` turns become assistant messages with a structured ``tool_calls`` entry (HF chat
                 templates render it in the model's own tool-call syntax; templates without tool support get the call
                 text back as content, see ``drafttrain.data.tokenize``); ``observation`` becomes a ``tool`` message.
  openai         ``messages`` of ``{role, content[, tool_calls]}``.
  alpaca         instruction + optional input (joined by a blank line) -> output or response; optional ``system`` and
                 ``history`` ([[prompt, answer], ...]); other keys (toolformer's ``example_input``) are ignored.
  fastchat       ``turns``: user prompts only -> prompt-only (``needs_response``). ``reference`` answers are judge
                 material, not target outputs, so they are not used.
  gsm8k          question -> answer, with the ``<<48/2=24>>`` calculator annotations removed (no chat model writes them).
  mbpp           the MBPP paper's prompt ("You are an expert Python programmer, and here is your task: ... Your code
                 should pass these tests: ...") -> the reference code in a ```python block; CRLF -> LF.
  self_instruct  instruction + instances[{input, output}]: ONE CONVERSATION PER INSTANCE (ids ``name:row.k``), since
                 each instance is a separate worked example of the task.

All text has CRLF/CR line endings turned into LF; content is otherwise kept verbatim (templates that trim, trim).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("sharegpt", "openai", "alpaca", "fastchat", "gsm8k", "mbpp", "self_instruct")
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",  # seen in ShareGPT dumps
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "ipython": "tool",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}
_GSM8K_CALCULATOR = re.compile(r"<<[^<>]*>>")
MBPP_PROMPT = "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:\n\n{tests}"


class SkipRecord(Exception):
    """A record that is well-formed for its format but unusable; the message is the counted reason."""


class FormatMismatch(Exception):
    """A record that does not fit the (detected or forced) format; the loader turns it into a DrafttrainError."""


@dataclasses.dataclass
class LoadedSource:
    """What one source produced: its conversations, how many records were read, and why the others were skipped."""

    name: str
    path: str
    conversations: list[dict]
    records: int
    skipped: Counter


# ----------------------------------------------------------------------------------------------- message helpers


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: keep the text parts, refuse anything else
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise SkipRecord(f"non-text content in {what}")
        value = "".join(parts)
    if not isinstance(value, str):
        raise SkipRecord(f"{what} is not a string")
    return value.replace("\r\n", "\n").replace("\r", "\n")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as a dict when they are JSON (templates apply ``tojson`` and would double-encode a string)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed
    return value


def parse_tool_call(text: str) -> dict | None:
    """A glaive/ShareGPT ``function_call`` value (``{"name": ..., "arguments": {...}}``) as an OpenAI tool call."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"type": "function", "function": {"name": call["name"], "arguments": _arguments(arguments)}}


def _normalise_tool_calls(calls: Any) -> list[dict]:
    out = []
    for call in calls or []:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SkipRecord("malformed tool_calls entry")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))}})
    return out


def message(role: str, content: str, tool_calls: list[dict] | None = None) -> dict:
    msg: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:  # only when present: Llama-3.1's template tests ``'tool_calls' in message``
        msg["tool_calls"] = tool_calls
    return msg


def finish_conversation(messages: list[dict], conv_id: str, source: str, tools: Any = None) -> dict:
    """Validate the messages and build the conversation dict (raises SkipRecord with the reason)."""
    # An empty final answer is a missing answer: the row can still serve as a prompt.
    while messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"].strip() \
            and not messages[-1].get("tool_calls"):
        messages.pop()
    if not messages:
        raise SkipRecord("no messages")
    for msg in messages:
        if msg["role"] in ("user", "assistant") and not msg["content"].strip() and not msg.get("tool_calls"):
            raise SkipRecord(f"empty {msg['role']} turn")
    if not any(m["role"] == "user" for m in messages):
        raise SkipRecord("no user turn")
    conv: dict[str, Any] = {
        "id": conv_id,
        "source": source,
        "messages": messages,
        "needs_response": not any(m["role"] == "assistant" for m in messages),
    }
    if tools:
        conv["tools"] = tools
    return conv


# ----------------------------------------------------------------------------------------------- formats


def detect_format(record: dict) -> str | None:
    """The format a record's keys say it is in, or None."""
    for key in ("conversations", "messages"):
        turns = record.get(key)
        if isinstance(turns, list):
            first = next((t for t in turns if isinstance(t, dict)), {})
            if "from" in first or "value" in first:
                return "sharegpt"
            if "role" in first:
                return "openai"
            return "sharegpt" if key == "conversations" else "openai"  # empty list: counted as "no messages" later
    if isinstance(record.get("turns"), list):
        return "fastchat"
    if "instruction" in record and isinstance(record.get("instances"), list):
        return "self_instruct"
    if "instruction" in record:
        return "alpaca"
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "text" in record and "code" in record:
        return "mbpp"
    return None


def _require(record: dict, fmt: str, *alternatives: tuple[str, ...]) -> None:
    for keys in alternatives:
        if not any(k in record for k in keys):
            raise FormatMismatch(f"format {fmt!r} needs a key {' or '.join(map(repr, keys))}")


def _turn_list(record: dict, fmt: str, keys: tuple[str, str]) -> list:
    """The record's list of turns, under its format's usual key or the other one."""
    _require(record, fmt, keys)
    turns = record.get(keys[0], record.get(keys[1]))
    if not isinstance(turns, list):
        raise FormatMismatch(f"format {fmt!r} needs {keys[0]!r} to be a list")
    return turns


def _from_sharegpt(record: dict, conv_id: str, source: str) -> list[dict]:
    turns = _turn_list(record, "sharegpt", ("conversations", "messages"))
    messages = []
    system = _text(record.get("system"), "system")
    if system.strip():
        messages.append(message("system", system))
    for turn in turns:
        if not isinstance(turn, dict) or "from" not in turn:
            raise FormatMismatch("format 'sharegpt' needs turns of the form {from, value}")
        sender = str(turn["from"]).lower()
        role = _SHAREGPT_ROLES.get(sender)
        if role is None:
            raise SkipRecord(f"unknown role {turn['from']!r}")
        content = _text(turn.get("value"), f"{sender} turn")
        if sender == "function_call":
            call = parse_tool_call(content)
            # A call that is not JSON stays readable text: still an assistant output worth training on.
            messages.append(message("assistant", "", [call]) if call else message("assistant", content))
        else:
            messages.append(message(role, content))
    return [finish_conversation(messages, conv_id, source, record.get("tools") or None)]


def _from_openai(record: dict, conv_id: str, source: str) -> list[dict]:
    turns = _turn_list(record, "openai", ("messages", "conversations"))
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or "role" not in turn:
            raise FormatMismatch("format 'openai' needs messages of the form {role, content}")
        role = _OPENAI_ROLES.get(str(turn["role"]).lower())
        if role is None:
            raise SkipRecord(f"unknown role {turn['role']!r}")
        calls = _normalise_tool_calls(turn.get("tool_calls")) if role == "assistant" else []
        messages.append(message(role, _text(turn.get("content"), f"{role} message"), calls))
    return [finish_conversation(messages, conv_id, source, record.get("tools") or None)]


def _prompt(instruction: str, extra: str) -> str:
    return f"{instruction}\n\n{extra}" if extra.strip() else instruction


def _from_alpaca(record: dict, conv_id: str, source: str) -> list[dict]:
    _require(record, "alpaca", ("instruction",))
    messages = []
    system = _text(record.get("system"), "system")
    if system.strip():
        messages.append(message("system", system))
    for pair in record.get("history") or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise SkipRecord("malformed history")
        messages += [message("user", _text(pair[0], "history")), message("assistant", _text(pair[1], "history"))]
    prompt = _prompt(_text(record["instruction"], "instruction"), _text(record.get("input"), "input"))
    answer = _text(record.get("output", record.get("response")), "output")
    messages += [message("user", prompt), message("assistant", answer)]
    return [finish_conversation(messages, conv_id, source)]


def _from_fastchat(record: dict, conv_id: str, source: str) -> list[dict]:
    _require(record, "fastchat", ("turns",))
    if not isinstance(record["turns"], list):
        raise FormatMismatch("format 'fastchat' needs 'turns' to be a list of strings")
    messages = [message("user", _text(turn, "turn")) for turn in record["turns"]]
    return [finish_conversation(messages, conv_id, source)]


def _from_gsm8k(record: dict, conv_id: str, source: str) -> list[dict]:
    _require(record, "gsm8k", ("question",), ("answer",))
    answer = _GSM8K_CALCULATOR.sub("", _text(record["answer"], "answer"))
    messages = [message("user", _text(record["question"], "question")), message("assistant", answer)]
    return [finish_conversation(messages, conv_id, source)]


def _from_mbpp(record: dict, conv_id: str, source: str) -> list[dict]:
    _require(record, "mbpp", ("text",), ("code",))
    tests = record.get("test_list") or []
    if not isinstance(tests, list):
        raise SkipRecord("test_list is not a list")
    setup = _text(record.get("test_setup_code"), "test_setup_code").strip()
    test_text = "\n".join(_text(t, "test") for t in ([setup] if setup else []) + tests)
    prompt = MBPP_PROMPT.format(text=_text(record["text"], "text").strip(), tests=test_text)
    code = _text(record["code"], "code").strip("\n")
    messages = [message("user", prompt), message("assistant", f"```python\n{code}\n```" if code.strip() else "")]
    return [finish_conversation(messages, conv_id, source)]


def _from_self_instruct(record: dict, conv_id: str, source: str) -> list[dict]:
    _require(record, "self_instruct", ("instruction",), ("instances",))
    instances = record["instances"]
    if not isinstance(instances, list) or not instances:
        raise SkipRecord("no instances")
    instruction = _text(record["instruction"], "instruction")
    out = []
    for k, inst in enumerate(instances):
        if not isinstance(inst, dict):
            raise SkipRecord("malformed instance")
        prompt = _prompt(instruction, _text(inst.get("input"), "input"))
        messages = [message("user", prompt), message("assistant", _text(inst.get("output"), "output"))]
        out.append(finish_conversation(messages, f"{conv_id}.{k}", source))
    return out


_NORMALISERS = {
    "sharegpt": _from_sharegpt,
    "openai": _from_openai,
    "alpaca": _from_alpaca,
    "fastchat": _from_fastchat,
    "gsm8k": _from_gsm8k,
    "mbpp": _from_mbpp,
    "self_instruct": _from_self_instruct,
}


def normalize_record(record: dict, fmt: str, conv_id: str, source: str) -> list[dict]:
    """Turn one dataset record into conversations (usually one). Raises SkipRecord or FormatMismatch."""
    if fmt == "auto":
        fmt = detect_format(record)
        if fmt is None:
            raise FormatMismatch("it matches no known format")
    return _NORMALISERS[fmt](record, conv_id, source)


# ----------------------------------------------------------------------------------------------- reading files


def source_name(path: str) -> str:
    """A short, stable name for a source: the file name without data/compression suffixes, or the Hub id."""
    p = Path(path)
    if not p.exists() and not _looks_like_file(path):
        return path.strip("/")
    name = p.name
    for suffix in (".gz",) + DATA_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or path


def _data_suffix(path: Path) -> str:
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return next((s for s in DATA_SUFFIXES if name.endswith(s)), "")


def _looks_like_file(path: str) -> bool:
    return path.startswith((".", "/", "~")) or path.lower().endswith((".gz", ".json", ".jsonl", ".parquet", ".csv", ".txt"))


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise DrafttrainError(f"data file {path}: not a valid gzip file ({err})") from None
    return data


def _jsonl_records(text: str, path: Path) -> Iterator[Any]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise DrafttrainError(f"data file {path}: line {lineno} is not valid JSON ({err.msg})") from None


def read_records(path: str | Path) -> list[dict]:
    """All records of a local .json (array) / .jsonl / .parquet file, each optionally gzipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DrafttrainError(f"data file not found: {path}")
    suffix = _data_suffix(path)
    if not suffix:
        raise DrafttrainError(
            f"data file {path}: unknown extension; use .json (an array of records), .jsonl or .parquet, "
            "optionally gzipped (.gz)"
        )
    data = _read_bytes(path)
    if not data.strip():
        raise DrafttrainError(f"data file {path} is empty")
    if suffix == ".parquet":
        records = _parquet_records(data, path)
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            raise DrafttrainError(f"data file {path}: not UTF-8 text ({err})") from None
        records = _json_records(text, path) if suffix == ".json" else list(_jsonl_records(text, path))
    if not records:
        raise DrafttrainError(f"data file {path} is empty (no records)")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DrafttrainError(f"data file {path}: record {i} is a {type(record).__name__}, not an object")
    return records


def _json_records(text: str, path: Path) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON Lines saved as .json (common with HF exports)
            return list(_jsonl_records(text, path))
        raise DrafttrainError(f"data file {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(value, dict):
        # A single top-level list (e.g. {"data": [...]}) is accepted; anything else is ambiguous.
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(value) == 1 and len(lists) == 1:
            return lists[0]
        raise DrafttrainError(f"data file {path}: expected a JSON array of records, found an object with keys "
                              f"{sorted(value)[:10]}")
    if not isinstance(value, list):
        raise DrafttrainError(f"data file {path}: expected a JSON array of records, found {type(value).__name__}")
    return value


def _parquet_records(data: bytes, path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # only for parquet files

    try:
        return pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DrafttrainError(f"data file {path}: not a readable parquet file ({err})") from None


def read_hub_records(path: str, subset: str | None, split: str) -> Iterable[dict]:
    """Records of a Hugging Face dataset (or a local dataset folder) through ``datasets.load_dataset``."""
    import datasets  # only for Hub datasets and parquet files

    try:
        return datasets.load_dataset(path, subset, split=split)
    except Exception as err:  # network, auth, missing config/split: all mean "could not get it"
        reason = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise DrafttrainError(
            f"could not load dataset {path!r} (subset={subset!r}, split={split!r}) with datasets.load_dataset: "
            f"{reason}. The Hub may be unreachable from here: download it where it is reachable (e.g. "
            f"datasets.load_dataset(...).to_json('data.jsonl')), copy the file here and set the source path to it "
            "(.json, .jsonl or .parquet, optionally .gz)."
        ) from None


# ----------------------------------------------------------------------------------------------- loading a source


def load_conversations(
    path: str,
    format: str = "auto",
    *,
    name: str | None = None,
    split: str = "train",
    subset: str | None = None,
) -> LoadedSource:
    """Read one source (local file or Hub dataset) and normalise every record into conversations.

    Unusable records are counted in ``skipped`` by reason; a record of the wrong shape is a DrafttrainError (it means
    the file or the forced format is wrong, and silently dropping rows would hide that).
    """
    if format != "auto" and format not in FORMATS:
        raise DrafttrainError(f"unknown data format {format!r}; known: auto, {', '.join(FORMATS)}")
    name = name or source_name(path)
    local = Path(path).expanduser()
    if local.is_file() or (_looks_like_file(path) and not local.is_dir()):
        records: Iterable[dict] = read_records(local)
    else:
        records = read_hub_records(path, subset, split)
    conversations: list[dict] = []
    skipped: Counter = Counter()
    count = 0
    for row, record in enumerate(records):
        count += 1
        try:
            conversations += normalize_record(record, format, f"{name}:{row}", name)
        except SkipRecord as why:
            skipped[str(why)] += 1
        except FormatMismatch as why:
            raise DrafttrainError(
                f"data source {path}: record {row} does not fit: {why}; keys seen: {sorted(record)}. "
                f"Known formats: {', '.join(FORMATS)} (set the source's format to force one)."
            ) from None
    if count == 0:
        raise DrafttrainError(f"data source {path} is empty (no records)")
    return LoadedSource(name=name, path=str(path), conversations=conversations, records=count, skipped=skipped)


# ----------------------------------------------------------------------------------------------- hashing


def _turn_key(msg: dict) -> list:
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls", [])]
    return [msg["role"], " ".join(msg["content"].split()), calls]


def conversation_hash(conversation: dict) -> str:
    """Content hash for deduplication: the user and assistant turns, whitespace-normalised (not ids or system)."""
    turns = [_turn_key(m) for m in conversation["messages"] if m["role"] in ("user", "assistant")]
    blob = json.dumps(turns, ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
