"""``evaluate()``: measure a proposer on a prompt set against plain decoding, in one process.

Every side of the run (drafttrain.evaluation.sides: the method, plain decoding, other compared proposers, the HF
references, a draft's original target) runs on the same rendered prompt, one after the other, and the order
rotates from one question to the next so that a slow phase of a shared machine hits every side alike. One
warm-up run of every side comes first and is not counted. Wall times are taken around each ``generate`` call,
with the same clock for every side (prefill included; prompt rendering excluded).

Multi-turn questions (MT-Bench) follow EAGLE's eval: turn t is asked after the side's *own* answers to turns
< t. At T=0 a lossless engine produces the baseline's text, so both sides see the same history.

No generated text is logged or stored: records hold token counts, timings and acceptance counts only. Only on
request (``feedback=``) are the method side's prompts and answers written, as training data for the next round
(drafttrain.evaluation.feedback).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.config import DecodeSettings
from drafttrain.cpu_linear import PackedLinears
from drafttrain.data.chat import stop_token_ids
from drafttrain.evaluation import metrics
from drafttrain.evaluation.feedback import FeedbackLog
from drafttrain.evaluation.records import (
    SideRun,
    comparison_line,
    original_target_line,
    prompt_record,
    reference_line,
    run_turns,
)
from drafttrain.evaluation.rounding import explain_mismatch, rounding_summary
from drafttrain.evaluation.run_info import Budget, LoadWatch, jsonable, now, run_config
from drafttrain.evaluation.sides import BASELINE, COMPARED, HF_REFERENCE, ORIGINAL_TARGET, Compared, Side, SideBuilder
from drafttrain.evaluation.suites import Question, Suite
from drafttrain.progress import progress_bar
from drafttrain.targets import Target

log = logging.getLogger(__name__)

WARMUP_NEW_TOKENS = 16


@dataclasses.dataclass
class EvalReport:
    """Result of :func:`evaluate`. ``overall`` and each ``categories[name]`` are :func:`metrics.summarize` objects;
    ``prompts`` holds one record per question (counts and timings, never text); ``references`` holds the
    optional Hugging Face ``generate`` lines (their throughput, and speed relative to our baseline)."""

    config: dict[str, Any]
    overall: dict[str, Any]
    categories: dict[str, dict[str, Any]]
    prompts: list[dict[str, Any]]
    references: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Other proposers run on the same prompts in the same process against the same baseline (``compare=``).
    comparisons: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Only for a draft that adapts its target: plain decoding of the original target on the same prompts.
    original_target: dict[str, Any] | None = None

    @property
    def greedy_match(self) -> float | None:
        return self.overall.get("greedy_match")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def evaluate(target: Target, method: str | Any, prompts: Suite | Sequence[Question | str],
             settings: DecodeSettings | None = None, *, calibration: Sequence[Question] = (),
             compare: Sequence[str | Compared] = (), baseline: bool = True, hf_reference: bool = False,
             proposer_kwargs: dict[str, Any] | None = None, progress: bool = True, warmup: bool = True,
             cpu_linear: str | None = None, time_budget_s: float | None = None, feedback: str | Path | None = None,
             **decode: Any) -> EvalReport:
    """Run ``method`` (a registered proposer name, a Proposer, or a trained Drafter) through the speculative
    decoder on every prompt, with plain decoding as the baseline, and return the metrics (drafttrain.evaluation.
    metrics defines them). ``settings`` (or ``decode`` keywords: depth=3, tree="dynamic", ...) say how to decode.

    ``prompts``: a :class:`Suite` (already selected), or questions, or plain strings (one single-turn question
    each, category "default"). ``compare``: other sides on the same prompts against the same baseline (names of
    draft-free proposers, or :class:`Compared`), into ``report.comparisons``. ``hf_reference`` adds HF ``generate``
    lines to ``report.references``. Depth or tree "auto" is chosen on ``calibration`` questions, never the
    reported ones (drafttrain.decoding.autodepth.choose_shape). ``cpu_linear``: on a CPU every side runs its linear
    layers through oneDNN with pre-packed weights ("packed", the default) or PyTorch's own ("default").
    ``time_budget_s``: no new prompt is started once the run (calibration included) has taken this long; at least
    one prompt is measured, and the report says how many were left out. ``feedback``: a JSONL file for the method
    side's answers with the target's accept/reject decisions (drafttrain.evaluation.feedback), for ``prepare``.
    """
    settings, started_at, load = DecodeSettings.of(settings, **decode), now(), LoadWatch()
    budget = Budget(time_budget_s)
    suite_name, questions = _as_questions(prompts)
    with PackedLinears(target.model, mode=cpu_linear) as kernels:
        stop_ids = stop_token_ids(target.tokenizer, target.model.generation_config)
        build = SideBuilder(target, settings, [q.turns[0] for q in calibration], stop_ids, kernels)
        sides = [build.compared(Compared(method, proposer_kwargs=proposer_kwargs or {}), method=True)]
        if baseline:
            sides.append(build.baseline())
            if sides[0].draft is not None and sides[0].draft.adapts_target:
                sides.append(build.original_target(sides[0].draft, sides[-1]))
        if hf_reference:
            sides += build.hf_references(sides[0])
        sides += [build.compared(c if isinstance(c, Compared) else Compared(c)) for c in compare]
        _check_labels(sides)
        if warmup:
            _warm_up(target, questions[0], sides, min(WARMUP_NEW_TOKENS, settings.max_new_tokens))
        runs, planned = [], len(questions)
        answers = None if feedback is None else FeedbackLog(target.tokenizer, target.name, stop_ids)
        for index, question in enumerate(progress_bar(questions, "eval", "prompt", enabled=progress)):
            if runs and budget.spent():
                break
            runs.append(_run_interleaved(target, question, sides, settings.max_new_tokens, index))
            if answers is not None:
                answers.add(question, runs[-1][0])
        questions = questions[: len(runs)]
        report = _summary(sides, questions, runs, settings.temperature)
        _judge_mismatches(target, report, sides, runs, settings.temperature)
        described = _described(sides, baseline, hf_reference)
        report.config = run_config(target, sides[0].choice.settings, suite=suite_name, questions=questions,
                                   described=described, stop_ids=stop_ids, started_at=started_at)
        report.config["cpu_linear"] = {"mode": kernels.mode, "packed_layers": kernels.count}
        _note_conditions(report, load, budget, len(runs), planned)
        if answers is not None:
            report.config["feedback"] = answers.write(feedback)
        return report


def _note_conditions(report: EvalReport, load: LoadWatch, budget: Budget, measured: int, planned: int) -> None:
    """The machine's load during the run and the time budget, in the report and, when they matter, the log."""
    report.config["machine_load"] = load.summary()
    if report.config["machine_load"]["contended"]:
        log.warning("%s", report.config["machine_load"]["note"])
    if budget.limit_s is not None:
        report.config["time_budget"] = budget.summary(measured, planned)
        if report.config["time_budget"]["over"]:
            log.warning("%s", report.config["time_budget"]["note"])


def _check_labels(sides: list[Side]) -> None:
    labels = [side.label for side in sides[1:] if side.role == COMPARED]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:  # one would silently replace the other in the report
        raise DrafttrainError(f"two compared sides are both labelled {repeated[0]!r}: give them labels "
                              "(--compare LABEL=FOLDER)")


def _warm_up(target: Target, question: Question, sides: list[Side], budget: int) -> None:
    """One short, uncounted run of every side: first-call costs (allocations, kernel selection) stay out."""
    first_turn = dataclasses.replace(question, turns=question.turns[:1])
    for side in sides:
        run_turns(target.tokenizer, first_turn, side.generator(budget), target.device)
        side.warmed_up()


def _run_interleaved(target: Target, question: Question, sides: list[Side], budget: int, rotation: int) -> list[SideRun]:
    """Every side on the question, in list order; the starting side rotates with ``rotation``."""
    order = [(i + rotation) % len(sides) for i in range(len(sides))]
    runs = {i: run_turns(target.tokenizer, question, sides[i].generator(budget), target.device) for i in order}
    return [runs[i] for i in range(len(sides))]


def _summary(sides: list[Side], questions: list[Question], runs: list[list[SideRun]], temperature: float) \
        -> EvalReport:
    """The method's per-prompt records and metrics, and one line for every other side, against the baseline."""
    base = next((i for i, side in enumerate(sides) if side.role == BASELINE), None)
    pairs = {i: [(r[i], None if base is None else r[base]) for r in runs] for i in range(1, len(sides))}
    records = [prompt_record(q, r[0], None if base is None else r[base], temperature) for q, r in zip(questions, runs)]
    depth = sides[0].choice.settings.depth
    categories = {name: metrics.summarize([r for r in records if r["category"] == name], depth)
                  for name in dict.fromkeys(r["category"] for r in records)}  # first-seen order
    lines = {role: {sides[i].label: pair for i, pair in pairs.items() if sides[i].role == role}
             for role in (COMPARED, HF_REFERENCE, ORIGINAL_TARGET)}
    original = lines[ORIGINAL_TARGET].get(ORIGINAL_TARGET)
    return EvalReport(
        config={}, overall=metrics.summarize(records, depth), categories=categories, prompts=records,
        references={label: reference_line(p, temperature) for label, p in lines[HF_REFERENCE].items()},
        comparisons={label: comparison_line(p, temperature) for label, p in lines[COMPARED].items()},
        original_target=None if original is None else original_target_line(original, records, temperature))


def _judge_mismatches(target: Target, report: EvalReport, sides: list[Side], runs: list[list[SideRun]],
                      temperature: float) -> None:
    """At T=0, the target's verdict on each side's first greedy mismatch in each prompt (drafttrain.evaluation.
    rounding: its own rounding, or a defect): the method's in its prompt records, a compared side's in its line."""
    base = next((i for i, side in enumerate(sides) if side.role == BASELINE), None)
    if temperature != 0 or base is None:
        return
    judged = {i: [explain_mismatch(target, r[i], r[base]) for r in runs]
              for i, side in enumerate(sides) if i == 0 or side.role == COMPARED}
    for record, verdict in zip(report.prompts, judged.pop(0)):
        record["mismatch_rounding"] = verdict
    report.overall["greedy_mismatches"] = rounding_summary([r["mismatch_rounding"] for r in report.prompts
                                                            if r["mismatch_rounding"]])
    for i, verdicts in judged.items():
        line = report.comparisons[sides[i].label]
        line["mismatches"] = [{"question_id": p["question_id"], **v} for p, v in zip(report.prompts, verdicts) if v]
        line["greedy_mismatches"] = rounding_summary(line["mismatches"])


def _described(sides: list[Side], baseline: bool, hf_reference: bool) -> dict[str, Any]:
    """What the report's config says of the sides: the method's proposer and auto choices, the others'."""
    method = sides[0]
    name = method.proposer_name
    if method.choice.depth_auto and method.choice.depth_auto["depth"] == 0:
        name = f"{name} (depth auto: plain decoding)"
    if method.choice.tree_auto and method.choice.tree_auto["plain_decoding"]:
        name = f"{name} (tree auto: plain decoding)"
    return {"proposer": name, "proposer_kwargs": jsonable(method.proposer_kwargs),
            "baseline": "plain_decode" if baseline else None, "hf_reference": hf_reference,
            "compare": [side.described() for side in sides[1:] if side.role == COMPARED],
            "draft": method.draft.identity() if method.draft is not None else None,
            "min_confidence": method.choice.settings.min_confidence,
            "depth_auto": method.choice.depth_auto, "tree_auto": method.choice.tree_auto,
            "runtime_check": method.choice.runtime_check()}


def _as_questions(prompts: Suite | Sequence[Question | str]) -> tuple[str, list[Question]]:
    if isinstance(prompts, Suite):
        name, items = prompts.name, list(prompts.questions)
    else:
        name = "custom"
        items = [
            p if isinstance(p, Question) else Question(question_id=str(i), category="default", turns=(p,))
            for i, p in enumerate(prompts)
        ]
    if not items:
        raise DrafttrainError(f"empty prompt set ({name}): nothing to evaluate")
    return name, items
