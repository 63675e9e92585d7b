"""Regeneration jobs: where in a conversation the target answers (answer slots), and one conversation being
answered slot after slot (what each backend fills in)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from drafttrain.data.regenerate.resume import RegenerationSettings, prompt_hash
from drafttrain.data.traffic import ANSWER_WEIGHTS

TOOL_CALL_KEYS = ("tool_calls", "function_call")


def is_tool_call(message: dict) -> bool:
    return any(message.get(key) for key in TOOL_CALL_KEYS)


def answer_slots(messages: Sequence[dict]) -> list[tuple[int, bool]]:
    """Where the target answers: (index in messages, True = replace the assistant turn there / False = insert)."""
    slots: list[tuple[int, bool]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
        if role == "assistant" and not is_tool_call(message):
            slots.append((i, True))
        elif role == "user" and nxt == "user":
            slots.append((i + 1, False))
        elif role in ("user", "tool") and nxt is None:
            slots.append((i + 1, False))
    return slots


class AnsweringModel(Protocol):
    """What the hf backend answers with: a causal LM (``model``) and its tokenizer. A drafttrain.targets.Target is
    one; this layer sits below the targets, so it names what it uses."""

    model: Any
    tokenizer: Any


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    num_tokens: int


@dataclasses.dataclass
class ConversationJob:
    """One conversation being regenerated, slot after slot."""

    conversation: dict
    slots: list[tuple[int, bool]]
    messages: list[dict] = dataclasses.field(default_factory=list)
    next_slot: int = 0
    shift: int = 0  # how many answers were inserted so far (original indices move right)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    generated_tokens: int = 0
    drop_reason: str | None = None
    kept_original: int = 0

    def __post_init__(self) -> None:
        self.messages = [dict(m) for m in self.conversation["messages"]]

    @property
    def done(self) -> bool:
        return self.drop_reason is not None or self.next_slot >= len(self.slots)

    def pending_prompt(self) -> list[dict]:
        index, _ = self.slots[self.next_slot]
        return self.messages[: index + self.shift]

    def accept(self, generation: Generation, keep_original_on_empty: bool) -> None:
        index, replaces = self.slots[self.next_slot]
        at = index + self.shift
        self.next_slot += 1
        self.generated_tokens += generation.num_tokens
        self.finish_reasons.append(generation.finish_reason)
        text = generation.text.strip()
        if not text:
            original = self.messages[at].get("content") if replaces else None
            if keep_original_on_empty and original:
                self.kept_original += 1
                return  # the dataset's answer stays in place
            self.drop_reason = "empty_answer_no_original" if keep_original_on_empty else "empty_answer"
            return
        answer = {**self.messages[at], "content": text} if replaces else {"role": "assistant", "content": text}
        answer.pop("truncated", None)
        if generation.finish_reason == "length":
            # Cut at max_new_tokens: the end-of-turn that the chat template adds after it was never generated.
            answer["truncated"] = True
        if replaces:
            self.messages[at] = answer
        else:
            self.messages.insert(at, answer)
            self.shift += 1

    def result(self, settings: RegenerationSettings) -> dict:
        answer = {"messages": self.messages, "finish_reason": "length" if "length" in self.finish_reasons else "stop",
                  "generated_tokens": self.generated_tokens}
        if self.kept_original:
            answer["kept_original_answers"] = self.kept_original
        return answered_row(self.conversation, answer, settings)


def answered_row(conversation: dict, answer: dict, settings: RegenerationSettings) -> dict:
    """The output row of a conversation with the target's answers (``answer``: messages, finish_reason, ...)."""
    row = {**conversation, **answer}
    row.pop(ANSWER_WEIGHTS, None)  # evaluation feedback describes the logged answer, not this one
    row["needs_response"] = False  # every user turn has its answer now
    row["regenerated_by"] = settings.target
    row["prompt_hash"] = prompt_hash(conversation)
    return row
