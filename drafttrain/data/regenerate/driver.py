"""Response regeneration: the target rewrites the assistant turns (self-distillation data).

A drafter is trained to predict what the *target* would say, so the responses in public datasets (written by
other models or people) are replaced by the target's own answers. For each conversation the turns are walked
in order; every answer slot gets the target's answer given the history so far, *including the answers already
regenerated for earlier turns* (so later turns stay coherent with the new earlier ones).

Answer slots:
  * every assistant text turn (its content is replaced);
  * after a user turn that is directly followed by another user turn, and after a final user or tool turn (an
    answer is inserted). This covers prompt-only conversations (FastChat question files, ``needs_response``):
    a multi-turn MT-Bench item becomes user, answer, user, answer.

Tool conversations: tool calls (assistant turns carrying ``tool_calls``/``function_call``) and tool results
(``tool`` turns) are kept exactly as given, and only the assistant *text* turns are regenerated. The target
cannot execute the tools, so inventing new calls would need fake observations; keeping the recorded call and
its result and regenerating the text that reads them keeps the conversation consistent.

Output: a jsonl file, one finished conversation per line (the original ``id``, ``source`` and other keys, plus
``regenerated_by``, ``finish_reason`` = ``length`` if any answer hit ``max_new_tokens`` else ``stop``,
``generated_tokens``, ``prompt_hash``); an answer cut at ``max_new_tokens`` carries ``"truncated": true``.
Beside it, ``<name>.settings.json`` records the generation settings and
``<name>.dropped.jsonl`` lists the ids dropped (with the reason) so a rerun does not retry them.

Resumable: each finished row is appended with flush + fsync. A rerun reads the file, skips the ids already
done and appends the rest; a truncated last line (the process was killed mid-write) is cut off and that row is
regenerated. Rerunning with different settings into the same file raises instead of mixing two distributions.

Sampling (temperature > 0) is reproducible per row: the noise comes from a generator seeded with
hash(seed, id, turn), applied with the Gumbel-max trick inside a greedy ``generate``. ``do_sample=True`` would
draw from one global stream shared by the whole batch, so a row's answer would depend on which rows happened
to share its batch, and a resumed run would not reproduce an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.data.regenerate.hf import HFBackend
from drafttrain.data.regenerate.jobs import AnsweringModel, ConversationJob, answer_slots, answered_row
from drafttrain.data.regenerate.openai_server import OpenAIBackend
from drafttrain.data.regenerate.resume import (
    OutputPaths,
    RegenerationSettings,
    append_jsonl,
    check_settings,
    prompt_hash,
    read_jsonl_resumable,
)
from drafttrain.data.regenerate.store import AnswerStore
from drafttrain.progress import progress_bar

log = logging.getLogger(__name__)

# The backends, by regenerate.backend: each answers jobs and calls back as each finishes (``run(jobs, on_done)``).
BACKENDS = {"hf": HFBackend, "openai": OpenAIBackend}


@dataclasses.dataclass
class RegenerationResult:
    conversations: list[dict]  # in input order; dropped rows left out
    path: Path
    reused: int  # rows found already done in the output (resume)
    from_store: int  # rows answered in an earlier run (of any recipe), taken from the answer store
    regenerated: int  # rows generated in this call
    dropped: dict[str, int]  # reason -> count, over all input rows (old and new)
    generated_tokens: int  # in this call
    seconds: float  # generation time in this call
    finish_reasons: dict[str, int]  # over the kept rows
    kept_original_answers: int  # empty answers replaced by the dataset's (keep_original_on_empty), kept rows

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "conversations": len(self.conversations),
            "reused_from_previous_run": self.reused,
            "reused_from_answer_store": self.from_store,
            "regenerated_now": self.regenerated,
            "dropped": dict(self.dropped),
            "finish_reason": dict(self.finish_reasons),
            "kept_original_answers": self.kept_original_answers,
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def _check_unique_ids(conversations: Iterable[dict]) -> None:
    seen: set[str] = set()
    for conversation in conversations:
        cid = conversation.get("id")
        if cid is None:
            raise DrafttrainError("every conversation needs an 'id' to make regeneration resumable")
        if str(cid) in seen:
            raise DrafttrainError(f"conversation id {cid!r} occurs twice; ids must be unique to resume safely")
        seen.add(str(cid))


def _index_done(rows: list[dict], wanted: dict[str, dict], where: Path) -> dict[str, dict]:
    """Rows already written, by id; a reused id whose source conversation changed is an error, not a skip."""
    done: dict[str, dict] = {}
    for row in rows:
        cid = str(row.get("id"))
        if cid in done:
            raise DrafttrainError(f"{where}: id {cid!r} appears twice; the file was not written by this tool")
        done[cid] = row
        source = wanted.get(cid)
        if source is not None and row.get("prompt_hash") != prompt_hash(source):
            raise DrafttrainError(
                f"{where}: the row for id {cid!r} was generated from a different conversation than the one with "
                "that id now (the input data changed); regenerate into a fresh output file"
            )
    return done


class Recorder:
    """Writes each finished conversation durably (its row, or its id in the dropped file, and the answer store)
    and keeps the counts for the result."""

    def __init__(self, paths: OutputPaths, settings: RegenerationSettings, store: AnswerStore | None,
                 done: dict[str, dict], dropped: dict[str, str], on_row: Callable[[dict], None] | None):
        self.paths, self.settings, self.store, self.on_row = paths, settings, store, on_row
        self.done, self.dropped = done, dropped
        self.tokens = self.regenerated = self.from_store = 0
        self.started, self.bar = time.perf_counter(), None

    def __enter__(self) -> "Recorder":
        self.rows_out = open(self.paths.rows, "a", encoding="utf-8")
        self.dropped_out = open(self.paths.dropped, "a", encoding="utf-8")
        self.store_out = open(self.store.path if self.store else os.devnull, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        for handle in (self.rows_out, self.dropped_out, self.store_out):
            handle.close()

    def answer_from_store(self, todo: list[ConversationJob], wanted: dict[str, dict]) -> list[ConversationJob]:
        """Answers this run already had join the store; conversations the store has answers for are written
        from it. Returns the jobs left to generate."""
        if self.store is None:
            return todo
        for cid, row in self.done.items():
            if cid in wanted and self.store.get(wanted[cid]) is None:
                self.store.put(self.store_out, wanted[cid], row)
        left = []
        for job in todo:
            answer = self.store.get(job.conversation)
            if answer is None:
                left.append(job)
                continue
            record = answered_row(job.conversation, answer, self.settings)
            append_jsonl(self.rows_out, record)
            self.done[str(job.conversation["id"])] = record
            self.from_store += 1
        if self.from_store:
            log.info("regenerate: %d conversations answered in earlier runs (%s)", self.from_store, self.store.path)
        return left

    def finished(self, job: ConversationJob) -> None:
        cid = str(job.conversation["id"])
        self.tokens += job.generated_tokens
        self.regenerated += 1
        if job.drop_reason:
            record = {"id": cid, "reason": job.drop_reason}
            append_jsonl(self.dropped_out, record)
            self.dropped[cid] = job.drop_reason
        else:
            record = job.result(self.settings)
            append_jsonl(self.rows_out, record)
            self.done[cid] = record
            if self.store is not None:
                self.store.put(self.store_out, job.conversation, record)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self.started, 1e-9):.1f}")
        if self.on_row is not None:
            self.on_row(record)

    def result(self, wanted: dict[str, dict], reused: int, generated: bool) -> RegenerationResult:
        kept = [self.done[cid] for cid in wanted if cid in self.done]
        return RegenerationResult(
            conversations=kept, path=self.paths.rows, reused=reused, from_store=self.from_store,
            regenerated=self.regenerated,
            dropped=dict(Counter(self.dropped[cid] for cid in wanted if cid in self.dropped)),
            generated_tokens=self.tokens, seconds=time.perf_counter() - self.started if generated else 0.0,
            finish_reasons=dict(Counter(row.get("finish_reason", "stop") for row in kept)),
            kept_original_answers=sum(int(row.get("kept_original_answers", 0)) for row in kept))


def regenerate_conversations(
    conversations: Sequence[dict],
    cfg: RegenerateConfig,
    output_path: str | Path,
    *,
    seed: int,
    target: AnsweringModel | None = None,
    target_name: str | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> RegenerationResult:
    """Replace the assistant turns of ``conversations`` with the target's answers, resumably, into ``output_path``.

    ``target`` (a :class:`drafttrain.targets.Target`) is needed for ``backend: hf``; ``target_name`` (default:
    ``target.name``) is what the settings record. ``on_row`` is called after each row is durably written (tests
    use it to interrupt a run). Returns the regenerated conversations in input order.
    """
    if target_name is None and target is None:
        raise DrafttrainError("regenerate_conversations needs a target or a target_name")
    settings = RegenerationSettings.from_config(cfg, target_name or target.name, seed,
                                                target.tokenizer if target is not None else None)
    paths = OutputPaths.for_output(output_path)
    paths.rows.parent.mkdir(parents=True, exist_ok=True)
    _check_unique_ids(conversations)
    wanted = {str(c["id"]): c for c in conversations}
    rows, dropped_rows = read_jsonl_resumable(paths.rows), read_jsonl_resumable(paths.dropped)
    check_settings(paths, settings, has_rows=bool(rows or dropped_rows))
    done = _index_done(rows, wanted, paths.rows)
    dropped = {str(r.get("id")): r.get("reason", "unknown") for r in dropped_rows}
    todo = [ConversationJob(c, answer_slots(c["messages"])) for c in conversations
            if str(c["id"]) not in done and str(c["id"]) not in dropped]
    reused = len(conversations) - len(todo)
    if reused:
        log.info("regenerate: %d of %d conversations already in %s, %d to go",
                 reused, len(conversations), paths.rows, len(todo))
    store = AnswerStore(settings, target.fingerprint if target is not None else None) if cfg.reuse_answers else None
    with Recorder(paths, settings, store, done, dropped, on_row) as recorder:
        todo = recorder.answer_from_store(todo, wanted)
        with progress_bar(total=len(todo), desc="regenerate", unit="conv", enabled=progress and bool(todo)) as bar:
            recorder.bar = bar
            if todo:
                BACKENDS[settings.backend](target, cfg, settings).run(todo, recorder.finished)
    return recorder.result(wanted, reused, generated=bool(todo))
