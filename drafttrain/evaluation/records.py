"""One side's run on a question (its turns, each after its own earlier answers, timed), the per-prompt record of
the method against the baseline, and the summary line of every other side. Records hold counts and timings,
never generated text."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from drafttrain.data.chat import prompt_ids
from drafttrain.evaluation import metrics
from drafttrain.evaluation.suites import Question
from drafttrain.targets import synchronize

# generate function of one side: rendered prompt ids (1, L) -> (new tokens, DecodeStats; for HF a dict of counts)
GenerateFn = Callable[[torch.Tensor], tuple[list[int], Any]]


@dataclasses.dataclass
class SideRun:
    """One side (method, baseline or an HF reference) on one question, all turns."""

    turn_tokens: list[list[int]]
    seconds: float
    stats: list[Any]  # per turn: DecodeStats, or {"target_forwards": n} for HF references
    prompt_ids: list[list[int]]  # per turn: the rendered prompt (a mismatch's context)

    @property
    def prompt_tokens(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.turn_tokens)


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The answer as the next turn's history sees it (stop and other special tokens dropped, as EAGLE's eval does)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def run_turns(tokenizer, question: Question, generate: GenerateFn, device: torch.device | None = None) -> SideRun:
    """Ask the question's turns in order, each after this side's own previous answers; time the generate calls.

    Prompts are rendered on the CPU and moved to ``device`` before the clock starts (HF's generate does not
    move them itself)."""
    history: list[dict[str, str]] = []
    turn_tokens, stats, turn_prompts, seconds = [], [], [], 0.0
    for turn in question.turns:
        messages = history + [{"role": "user", "content": turn}]
        turn_prompts.append(prompt_ids(tokenizer, messages))
        ids = torch.tensor([turn_prompts[-1]])
        if device is not None:
            ids = ids.to(device)
        synchronize(ids.device)
        start = time.perf_counter()
        tokens, turn_stats = generate(ids)
        synchronize(ids.device)
        seconds += time.perf_counter() - start
        turn_tokens.append(tokens)
        stats.append(turn_stats)
        history = messages + [{"role": "assistant", "content": answer_text(tokenizer, tokens)}]
    return SideRun(turn_tokens=turn_tokens, seconds=seconds, stats=stats, prompt_ids=turn_prompts)


def _stats_lists(stats: list[Any], field: str) -> list[int]:
    return [v for s in stats for v in getattr(s, field)]


def _sum_positions(stats: list[Any], field: str) -> list[int]:
    total: list[int] = []
    for s in stats:
        values = list(getattr(s, field, []) or [])
        total += [0] * (len(values) - len(total))
        for i, v in enumerate(values):
            total[i] += int(v)
    return total


def _step_lists(run: SideRun) -> dict[str, list[int]]:
    """The run's steps, all turns in order: accepted and drafted tokens, the tokens each verification fed, and the
    context length each drafted from."""
    return {"accepted_per_step": _stats_lists(run.stats, "accepted_per_step"),
            "drafted_per_step": _stats_lists(run.stats, "drafted_per_step"),
            "fed_per_step": _stats_lists(run.stats, "fed_per_step"),
            "context_per_step": [ctx for prompt, s in zip(run.prompt_tokens, run.stats)
                                 for ctx in metrics.contexts_per_step(prompt, s.accepted_per_step)]}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal); a length difference counts at the shorter end."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_record(question: Question, method: SideRun, base: SideRun | None, temperature: float) -> dict[str, Any]:
    """The method's counts, timings and acceptance on one question, against the baseline's run of it."""
    stats = method.stats
    steps = _step_lists(method)
    accepted, drafted = steps["accepted_per_step"], steps["drafted_per_step"]
    record: dict[str, Any] = {
        "question_id": question.question_id,
        "category": question.category,
        "turns": len(question.turns),
        "prompt_tokens": method.prompt_tokens,
        "new_tokens": method.new_tokens,
        "turn_new_tokens": [len(t) for t in method.turn_tokens],
        "wall_time_s": method.seconds,
        "tokens_per_s": metrics.tokens_per_s(method.new_tokens, method.seconds),
        "target_forwards": sum(int(s.target_forwards) for s in stats),
        "tau": metrics.tau(accepted),
        "acceptance_rate": metrics.acceptance_rate(accepted, drafted),
        **steps,
        # The engine's own per-depth counters, kept raw (the report derives per-position rates from the steps).
        "engine_position_drafted": _sum_positions(stats, "position_drafted"),
        "engine_position_accepted": _sum_positions(stats, "position_accepted"),
        "prefill_time_s": sum(float(s.prefill_time_s) for s in stats),
        "proposer_time_s": sum(float(s.proposer_time_s) for s in stats),
        "verify_time_s": sum(float(s.verify_time_s) for s in stats),
        "rollback_time_s": sum(float(s.rollback_time_s) for s in stats),
        "baseline_new_tokens": None,
        "baseline_wall_time_s": None,
        "baseline_tokens_per_s": None,
        "speedup": None,
        "greedy_match": None,
        "first_mismatch": None,
    }
    if base is not None:
        record.update(
            baseline_new_tokens=base.new_tokens,
            baseline_turn_new_tokens=[len(t) for t in base.turn_tokens],
            baseline_wall_time_s=base.seconds,
            baseline_tokens_per_s=metrics.tokens_per_s(base.new_tokens, base.seconds),
            speedup=metrics.speedup([method.new_tokens], [method.seconds], [base.new_tokens], [base.seconds]),
        )
        if temperature == 0:
            mismatches = [first_mismatch(m, b) for m, b in zip(method.turn_tokens, base.turn_tokens)]
            record["greedy_match"] = all(m is None for m in mismatches)
            # Where each turn first diverged (token index), to debug losslessness without storing text.
            record["first_mismatch"] = mismatches
    return record


def _hf_tau_estimate(runs: list[SideRun]) -> float | None:
    """Σ new tokens / Σ target forwards. Every HF forward emits accepted + 1 tokens: plain decoding's prefill
    emits the first token, and assisted / prompt-lookup decoding verifies its first draft inside the prefill
    forward. So this is τ's counterpart (up to a truncated last step); plain decoding gives exactly 1."""
    tokens = sum(len(t) for run in runs for t in run.turn_tokens)
    forwards = sum(stats["target_forwards"] for run in runs for stats in run.stats)
    return tokens / forwards if forwards else None


def reference_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    return dict(_speed_line(pairs, temperature), tau_estimate=_hf_tau_estimate([r for r, _ in pairs]))


def _speed_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    """Throughput of one extra side, its speed against the baseline on the same prompts, and greedy agreement."""
    tokens = sum(r.new_tokens for r, _ in pairs)
    seconds = sum(r.seconds for r, _ in pairs)
    line = {
        "tokens_per_s": metrics.tokens_per_s(tokens, seconds),
        "new_tokens": tokens,
        "wall_time_s": seconds,
        "speed_vs_baseline": None,
        "greedy_match_vs_baseline": None,
    }
    bases = [b for _, b in pairs if b is not None]
    if len(bases) == len(pairs) and pairs:
        columns = ([r.new_tokens for r, _ in pairs], [r.seconds for r, _ in pairs],
                   [b.new_tokens for b in bases], [b.seconds for b in bases])
        line["speed_vs_baseline"] = metrics.speedup(*columns)
        line["speed_vs_baseline_ci95"] = metrics.speedup_interval(*columns)
        if temperature == 0:
            line["greedy_match_vs_baseline"] = metrics.greedy_match_share(
                [r.turn_tokens == b.turn_tokens for r, b in pairs]
            )
    return line


def original_target_line(pairs: list[tuple[SideRun, SideRun | None]], records: list[dict[str, Any]],
                          temperature: float) -> dict[str, Any]:
    """The original target's plain decoding against the adapted one (greedy agreement: how far the target moved)
    and the method's speedup against it (what a user who swaps the original for adapted target + heads gets)."""
    line = _speed_line(pairs, temperature)
    line["method_speedup_vs_original"] = metrics.speedup(
        [r["new_tokens"] for r in records], [r["wall_time_s"] for r in records],
        [r.new_tokens for r, _ in pairs], [r.seconds for r, _ in pairs])
    return line


def comparison_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    """A speed line with the engine's own τ and acceptance."""
    line = _speed_line(pairs, temperature)
    steps = [_step_lists(run) for run, _ in pairs]
    accepted = [a for s in steps for a in s["accepted_per_step"]]
    drafted = [d for s in steps for d in s["drafted_per_step"]]
    return dict(line, tau=metrics.tau(accepted), acceptance_rate=metrics.acceptance_rate(accepted, drafted),
                tokens_per_verification=metrics.tokens_per_verification(steps), by_context=metrics.by_context(steps))
