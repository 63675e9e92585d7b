"""Benchmark question sets in FastChat's question format: one JSON object per line,
``{"question_id": ..., "category": "...", "turns": ["first user turn", "second user turn", ...]}``.

Built-in suites live in the repository's ``eval/`` folder (see ``eval/SOURCES.md`` for provenance and licences):
``mt_bench`` (80 questions, 2 turns, 8 categories x 10, in file order), ``humaneval``, ``gsm8k``, ``alpaca``
(80 single-turn questions each, as used by SafeAILab/EAGLE's evaluation), and ``long_context`` (24 single-turn
prompts of 2k-8k tokens: a long code file or reference text and a request about it).

Selection is deterministic: ``num_prompts=N`` takes N questions one category at a time in turn (each category's in
file order; no shuffling, no sampling), so two runs with the same N see the same prompts and a small N covers every
category (MT-Bench's file is grouped by category). The report lists the chosen question_ids, so the same prompts
can be served elsewhere; use all 80 for a per-category picture comparable with published numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Literal

from drafttrain import DrafttrainError
from drafttrain.userfiles import read_text

# copied byte for byte from public files; long_context is built by scripts/tools/build_long_context_suite.py from
# Python's own standard library and language reference (PSF licence): 24 prompts of 2k-8k tokens
COPIED_SUITES: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca")
BUILTIN_SUITES: tuple[str, ...] = (*COPIED_SUITES, "long_context")

@dataclasses.dataclass(frozen=True)
class Question:
    """One benchmark question: the user turns, asked in order, each after the model's own previous answer."""

    question_id: str
    category: str
    turns: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str  # built-in name, or the file's path for a custom file
    source: str  # the file it was read from
    questions: tuple[Question, ...]

    def select(self, num_prompts: int | None = None, turns: Literal["1", "all"] | int | str = "all") -> "Suite":
        """``num_prompts`` questions taken round-robin over the categories (in file order within each, categories
        in order of first appearance), so a small slice still covers every category; keeps only the first turn
        when ``turns`` is 1. Deterministic."""
        if num_prompts is not None and num_prompts <= 0:
            raise DrafttrainError(f"--num-prompts must be positive, got {num_prompts}")
        keep_turns = _parse_turns(turns)
        chosen = _round_robin(self.questions)[:num_prompts] if num_prompts is not None else self.questions
        if keep_turns is not None:
            chosen = tuple(dataclasses.replace(q, turns=q.turns[:keep_turns]) for q in chosen)
        return dataclasses.replace(self, questions=tuple(chosen))

    def __len__(self) -> int:
        return len(self.questions)


def _round_robin(questions: tuple[Question, ...]) -> tuple[Question, ...]:
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    queues = list(by_category.values())
    return tuple(q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q))


def _parse_turns(turns: str | int) -> int | None:
    if str(turns) == "all":
        return None
    if str(turns) == "1":
        return 1
    raise DrafttrainError(f"--turns must be 1 or all, got {turns!r}")


def suite_dir() -> Path:
    """Where the built-in suites live: $DRAFTTRAIN_EVAL_DIR, else the repository's ``eval/`` folder."""
    override = os.environ.get("DRAFTTRAIN_EVAL_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "eval"


def load_suite(name_or_path: str | Path) -> Suite:
    """A built-in suite by name, or any FastChat-format ``.jsonl`` file by path.

    Raises DrafttrainError naming the suite (or file and line) for an unknown name, a missing or malformed file,
    or a file without any prompt.
    """
    spec = str(name_or_path)
    if spec in BUILTIN_SUITES:
        path = suite_dir() / f"{spec}.jsonl"
        if not path.is_file():
            raise DrafttrainError(f"built-in suite {spec!r}: its file {path} is missing (set DRAFTTRAIN_EVAL_DIR)")
        return Suite(name=spec, source=str(path), questions=_read_questions(path, fallback_category=spec))
    path = Path(spec).expanduser()
    if path.is_file():
        return Suite(name=str(path), source=str(path), questions=_read_questions(path, fallback_category=path.stem))
    if path.suffix in (".jsonl", ".json") or os.sep in spec:
        raise DrafttrainError(f"question file not found: {path}")
    raise DrafttrainError(
        f"unknown suite {spec!r}: use one of {', '.join(BUILTIN_SUITES)} or pass a FastChat-format .jsonl file "
        "(question_id, category, turns)"
    )


def _read_questions(path: Path, fallback_category: str) -> tuple[Question, ...]:
    questions = []
    for line_no, line in enumerate(read_text(path, "question file").splitlines(), start=1):
        if line.strip():
            questions.append(_parse_question(line, f"{path}:{line_no}", fallback_category))
    if not questions:
        raise DrafttrainError(f"question file {path} holds no prompts (empty prompt set)")
    return tuple(questions)


def _parse_question(line: str, where: str, fallback_category: str) -> Question:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DrafttrainError(f"malformed question file {where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise DrafttrainError(f"malformed question file {where}: expected a JSON object per line")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DrafttrainError(f"malformed question file {where}: 'turns' must be a non-empty list of non-empty strings")
    if "question_id" not in row:
        raise DrafttrainError(f"malformed question file {where}: missing 'question_id'")
    # EAGLE's alpaca file has category "" for every row: group such questions under the suite's name.
    category = row.get("category") or fallback_category
    if not isinstance(category, str):
        raise DrafttrainError(f"malformed question file {where}: 'category' must be a string")
    return Question(question_id=str(row["question_id"]), category=category, turns=tuple(turns))


def without_reported(candidates: Suite, reported: Suite) -> Suite:
    """``candidates``' questions whose first turn is not also one of ``reported``'s (compared without surrounding
    whitespace): the prompts that choose a checkpoint or a depth are never the ones a report is measured on."""
    seen = {q.turns[0].strip() for q in reported.questions}
    return dataclasses.replace(candidates, questions=tuple(q for q in candidates.questions
                                                           if q.turns[0].strip() not in seen))


def served_kind(reported: Suite, count: int) -> tuple[Question, ...]:
    """Up to ``count`` first turns of the reported suite that are not themselves reported (taken one category at a
    time): prompts of the kind being served, for depth or tree auto to calibrate on. Prompts of the training
    mixture accept better than a served suite does, and a choice calibrated there overstates its gain."""
    whole = load_suite(reported.name).select(turns="1")
    rest = without_reported(whole, reported)
    return rest.select(count).questions if rest.questions else ()

