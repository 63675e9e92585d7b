"""How a conversation meets the target: rendered in its own chat template, and where its answer stops.

One rule for every stage. Regeneration (the target writing training answers), tokenisation (the loss masks),
evaluation and serving all render prompts with :func:`prompt_ids` and stop at :func:`stop_token_ids`, so the head
is trained on answers that end exactly where the answers it serves end.

Templates differ in what they can render. :func:`template_support` finds out by rendering probes, and
:func:`adapt_to_template` rewrites a conversation so that any template renders it: for a template that ignores
tool calls (SmolLM2's plain ChatML) a call is written into the assistant content as ``{"name": ..., "arguments":
...}`` JSON, tool definitions go into the system message, and tool results become user turns if the template
refuses the ``tool`` role; a template that refuses the ``system`` role (Gemma) gets the system text at the start of
the first user turn.

Stop tokens: the template's own end-of-turn token (found by rendering an answer and reading what the template
writes right after it: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>`` ...) plus the EOS ids of the model's
generation config and of the tokenizer. No model-specific list anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from drafttrain import DrafttrainError

TOOLS_SYSTEM_HEADER = "You have access to the following functions:"
_PROBE = "drafttrain_probe_7f3a"


class TemplateRejected(Exception):
    """The chat template raised on this conversation (the message says why)."""


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template, or a DrafttrainError saying how to provide one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DrafttrainError(
            f"tokenizer {name!r} has no chat template, so conversations cannot be rendered the way the target sees "
            "them. Set target.chat_template in the recipe to the Jinja template text or to a .jinja file (e.g. the "
            "'chat_template' of the model's tokenizer_config.json)."
        )
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def render_text(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    """The conversation as text in the tokenizer's template (raises TemplateRejected if the template refuses it)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except DrafttrainError:
        raise
    except Exception as err:  # jinja raise_exception(), UndefinedError, TypeError from odd content ...
        first_line = (str(err).splitlines() or [err.__class__.__name__])[0][:100]
        raise TemplateRejected(f"chat template rejected the conversation: {first_line}") from None
    if not isinstance(text, str):  # defensive: transformers 5 returns BatchEncoding unless tokenize=False
        raise DrafttrainError("apply_chat_template(tokenize=False) did not return text")
    return text


# ----------------------------------------------------------------------------------------------- what a template renders


@dataclasses.dataclass(frozen=True)
class TemplateSupport:
    tool_calls: bool  # renders assistant ``tool_calls``
    tools: bool  # renders the ``tools`` definitions
    tool_role: bool  # renders ``tool`` messages
    system_role: bool = True  # accepts a ``system`` message (Gemma's template refuses it)


def _probe_call(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"x": 1}}}


def _probe_renders(tokenizer, messages: list[dict], tools: list | None, marker: str) -> bool:
    try:
        return marker in render_text(tokenizer, messages, tools, False)
    except TemplateRejected:
        return False


def _template_key(tokenizer) -> str:
    """Cache key: the template text and the bos/eos tokens it may print (not the tokenizer object)."""
    template = chat_template_text(tokenizer)
    return f"{template}\0{getattr(tokenizer, 'bos_token', None)}\0{getattr(tokenizer, 'eos_token', None)}"


_SUPPORT_CACHE: dict[str, TemplateSupport] = {}


def template_support(tokenizer) -> TemplateSupport:
    """What the template does with tool calls, tool definitions, tool results and system turns (probed)."""
    key = _template_key(tokenizer)
    if key not in _SUPPORT_CACHE:
        user = {"role": "user", "content": "hi"}
        call = {"role": "assistant", "content": "", "tool_calls": [_probe_call(_PROBE + "_call")]}
        tool_def = [{"type": "function", "function": {"name": _PROBE + "_def", "description": "probe",
                                                      "parameters": {"type": "object", "properties": {}}}}]
        calls = _probe_renders(tokenizer, [user, call], None, _PROBE + "_call")
        answer = call if calls else {"role": "assistant", "content": "calling"}
        tool_turn = {"role": "tool", "content": _PROBE + "_result"}
        system = {"role": "system", "content": _PROBE + "_system"}
        _SUPPORT_CACHE[key] = TemplateSupport(
            tool_calls=calls,
            tools=_probe_renders(tokenizer, [user], tool_def, _PROBE + "_def"),
            tool_role=_probe_renders(tokenizer, [user, answer, tool_turn], None, _PROBE + "_result"),
            system_role=_probe_renders(tokenizer, [system, user], None, _PROBE + "_system"),
        )
    return _SUPPORT_CACHE[key]


def tool_definitions(tools: Any) -> tuple[list | None, str | None]:
    """(OpenAI-style tool list, or raw text when the dataset's tools are not JSON)."""
    if not tools:
        return None, None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return None, tools
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        return None, str(tools)
    wrapped = [t if isinstance(t, dict) and t.get("type") == "function" and "function" in t
               else {"type": "function", "function": t} for t in tools]
    return wrapped, None


def _call_text(call: dict) -> str:
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)


def adapt_to_template(conversation: dict, support: TemplateSupport) -> tuple[list[dict], list | None]:
    """Messages and tools as this template can render them (see the module docstring)."""
    tools, tools_text = tool_definitions(conversation.get("tools"))
    messages = [dict(m) for m in conversation["messages"]]
    if not support.tool_calls:
        for msg in messages:
            if msg.get("tool_calls"):
                calls = "\n".join(_call_text(c) for c in msg.pop("tool_calls"))
                msg["content"] = f"{msg['content']}\n{calls}" if msg["content"] else calls
    if not support.tool_role:
        messages = [dict(m, role="user") if m["role"] == "tool" else m for m in messages]
    if tools is not None and not support.tools:
        tools_text = TOOLS_SYSTEM_HEADER + "\n" + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        tools = None
    if tools_text:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{tools_text}"
        else:
            messages.insert(0, {"role": "system", "content": tools_text})
    if not support.system_role and messages and messages[0]["role"] == "system":
        # The usual workaround for system-less templates: the instructions open the first user turn.
        system = messages.pop(0)["content"]
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is not None:
            first_user["content"] = f"{system}\n\n{first_user['content']}"
    return messages, tools


# ----------------------------------------------------------------------------------------------- prompts


def prompt_ids(tokenizer, messages: list[dict], tools: Any = None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header: what the target continues.

    Rendered exactly as tokenisation renders training rows (``prompt_text``), then tokenised as that text says.
    """
    text, special = prompt_text(tokenizer, messages, tools)
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def prompt_text(tokenizer, messages: list[dict], tools: Any = None) -> tuple[str, bool]:
    """The text ``prompt_ids`` tokenises, and whether the tokenizer must add its special tokens to it: what an
    OpenAI-compatible server is sent (``add_special_tokens``) to see exactly the ids our evaluator decodes from.

    A tokenizer without a template (a base model) gets the turns joined by blank lines, with its usual BOS.
    """
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n".join(m["content"] for m in messages) + "\n\n", True
    adapted, tool_list = adapt_to_template({"messages": messages, "tools": tools}, template_support(tokenizer))
    try:
        text = render_text(tokenizer, adapted, tool_list, add_generation_prompt=True)
    except TemplateRejected as err:
        raise DrafttrainError(str(err)) from None
    # The template already holds any BOS it wants; adding special tokens again would double it.
    return text, False


# ----------------------------------------------------------------------------------------------- where answers stop


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    return ids


_END_OF_TURN_CACHE: dict[str, tuple[int, ...]] = {}


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special tokens the template writes right after an assistant answer (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    key = _template_key(tokenizer) + f"\0{len(tokenizer)}"
    if key not in _END_OF_TURN_CACHE:
        answer = _PROBE + "_answer"
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
        adapted, _ = adapt_to_template({"messages": messages}, template_support(tokenizer))
        try:
            text = render_text(tokenizer, adapted, None, add_generation_prompt=False)
        except TemplateRejected:
            text = ""
        at = text.rfind(answer)
        tail = text[at + len(answer):].strip() if at >= 0 else ""
        specials = _special_ids(tokenizer)
        found = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
        _END_OF_TURN_CACHE[key] = tuple(dict.fromkeys(i for i in found if i in specials))
    return list(_END_OF_TURN_CACHE[key])


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """EOS ids of the generation config and of the tokenizer, in that order, without repeats."""
    ids: list[int] = []
    for source in (generation_config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        for value in eos if isinstance(eos, (list, tuple)) else [eos]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return ids


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Where every answer stops: the template's end-of-turn tokens, then the EOS ids (sorted, unique)."""
    ids = set(end_of_turn_ids(tokenizer)) | set(eos_token_ids(tokenizer, generation_config))
    if not ids:
        raise DrafttrainError("the tokenizer has no EOS token and its template no end-of-turn token: "
                              "cannot tell where an answer ends")
    return sorted(ids)
