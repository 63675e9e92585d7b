"""Evaluation as training signal (the closed loop): every answer the method side gave, as a request-log line that
``prepare`` reads back (drafttrain.data.traffic, format ``request_log``), with what the target decided about the
draft.

One line per turn: the messages the turn was asked with (the side's own earlier answers as history, exactly as the
evaluator asked them), the answer as the next turn's history sees it, and under ``drafttrain_feedback`` the token
ids the target emitted, ``rejected_at`` (indices into them where the target's token replaced draft tokens it
refused: there the draft was wrong, and a source's ``rejected_weight`` weighs those positions up), and ``complete``
(the answer ended with a stop token rather than at the token limit). The response's ``model`` is the target's name,
so ``prepare`` keeps the answers as the target's own instead of re-answering them.

Written on request only (``drafttrain eval --feedback``): it holds the prompts and generated text, which reports
never do. Prompts from an evaluation suite are for measuring: feed back the prompts of your own traffic (--questions),
and measure on others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drafttrain.data.traffic import FEEDBACK_KEY
from drafttrain.evaluation.records import SideRun, answer_text
from drafttrain.evaluation.suites import Question
from drafttrain.runfolder import write_text_atomic


def rejected_positions(accepted_per_step: list[int], rejected_per_step: list[bool], emitted: int) -> list[int]:
    """Indices into a generate call's ``emitted`` new tokens where the target replaced refused draft tokens. The
    first token comes from the prefill; each step then emits its accepted draft tokens and one target token, which
    is a correction when the step refused draft tokens (DecodeStats.rejected_per_step)."""
    at, out = 1, []
    for accepted, rejected in zip(accepted_per_step, rejected_per_step, strict=True):
        at += accepted
        if rejected and at < emitted:  # the last step may be cut by the token limit or a stop token
            out.append(at)
        at += 1
    return out


class FeedbackLog:
    """Collects the method side's answers question by question; ``write`` puts them in one file at once."""

    def __init__(self, tokenizer, target_name: str, stop_ids: set[int]):
        self.tokenizer, self.target_name, self.stop_ids = tokenizer, target_name, set(stop_ids)
        self.lines: list[dict[str, Any]] = []

    def add(self, question: Question, run: SideRun) -> None:
        history: list[dict[str, str]] = []
        for turn, tokens, stats in zip(question.turns, run.turn_tokens, run.stats, strict=True):
            messages = history + [{"role": "user", "content": turn}]
            complete = bool(tokens) and tokens[-1] in self.stop_ids
            if tokens:  # the answer's text as emitted (a trailing space of a cut answer is part of its ids)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                self.lines.append(self._line(messages, text, tokens, complete,
                                             rejected_positions(stats.accepted_per_step, stats.rejected_per_step,
                                                                len(tokens))))
            history = messages + [{"role": "assistant", "content": answer_text(self.tokenizer, tokens)}]

    def _line(self, messages: list[dict], text: str, tokens: list[int], complete: bool,
              rejected: list[int]) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "stop" if complete else "length"}
        return {"request": {"model": self.target_name, "messages": messages},
                "response": {"model": self.target_name, "choices": [choice]},
                FEEDBACK_KEY: {"answer_ids": list(tokens), "rejected_at": rejected, "complete": complete}}

    def write(self, path: str | Path) -> dict[str, Any]:
        """The lines as JSONL at ``path`` (written whole, then renamed into place); what the report records."""
        path = Path(path)
        write_text_atomic(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in self.lines))
        rejected = sum(len(line[FEEDBACK_KEY]["rejected_at"]) for line in self.lines)
        tokens = sum(len(line[FEEDBACK_KEY]["answer_ids"]) for line in self.lines)
        return {"path": str(path), "answers": len(self.lines), "tokens": tokens, "rejected_positions": rejected}
