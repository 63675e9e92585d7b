"""Speculative-decoding metrics as pure functions of per-step counts and timings.

Definitions (one *step* = one target verification forward; the prefill forward is not a step):

* **tau** (τ, "average acceptance length" in EAGLE's papers and eval scripts): the mean over steps of
  ``accepted + 1``, where ``accepted`` is the number of drafted tokens the target accepted in that step and
  the ``+ 1`` is the token the target itself contributes at every step (the correction after the first
  rejection, or the bonus token after a fully accepted draft). τ = tokens produced per verification forward.
  Steps are pooled over all prompts of a group (not a mean of per-prompt means). The token produced by the
  prefill forward belongs to no step, so ``new_tokens / steps`` is slightly above τ on short generations.
  A step whose proposer offered nothing (prompt lookup without a match) counts with ``accepted = 0``.
* **acceptance rate**: total accepted / total drafted tokens, where a step's "drafted" is the engine's
  ``drafted_per_step``: the chain length, or for a tree the depth of its deepest path (not its node count).
* **per-position acceptance**, for depth d = 1..D over the steps that drafted at least one token:
  ``cumulative[d] = P(depth d accepted)`` = share of those steps whose accepted prefix reaches depth d;
  ``conditional[d] = P(depth d accepted | depth d-1 accepted)`` = cumulative[d] / cumulative[d-1]
  (cumulative[0] = 1). A step whose draft stopped before depth d counts as not accepting it, so these are
  probabilities of *getting* the token, and ``simulated_tau(conditional)`` reproduces the measured τ of
  the steps that drafted (exactly, whenever every step drafted at least one token).
* **speedup** = method throughput / baseline throughput over the whole set, each throughput being total new
  tokens / total wall time (prefill included); **speedup_mean_of_ratios** = mean over prompts of the
  per-prompt throughput ratios (small prompts weigh as much as long ones; reported for comparison);
  **speedup_ratio_of_mean_speeds** = mean per-prompt method tokens/s ÷ mean per-prompt baseline tokens/s,
  the convention of SafeAILab/EAGLE's ``eagle/evaluation/speed.py``, for like-for-like comparison with it.
* **by context length**: the same τ, acceptance and per-position acceptance over the steps whose context (the
  prompt, history included, plus the tokens already generated in that turn) falls in each bucket of
  :data:`CONTEXT_BUCKETS`, so a decay with long prompts is seen before it costs a RAG or agent deployment.
* **tokens per verification**: the mean number of tokens a verification forward fed: the root, the draft's nodes
  (every node of a tree) and any side tokens of its proposer (lookahead's window). It is a step's width, which a
  step's cost grows with where the target is compute-bound (a CPU), beside τ, what the step gave.
* **greedy_match** (T=0 only): share of prompts whose method tokens equal the baseline tokens exactly. A
  lossless engine gives 1.0; anything less is a bug (or float nondeterminism worth investigating).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from drafttrain.decoding.verify import expected_acceptance_rate as expected_acceptance  # noqa: F401  (Σ min(p, q))
from drafttrain.drafts.base import simulated_tau  # noqa: F401  (τ from per-position acceptance)


def tau(accepted_per_step: Sequence[int]) -> float | None:
    """Mean tokens per verification forward, bonus included: mean over steps of (accepted + 1). None if no step."""
    if not accepted_per_step:
        return None
    return sum(a + 1 for a in accepted_per_step) / len(accepted_per_step)


def acceptance_rate(accepted_per_step: Sequence[int], drafted_per_step: Sequence[int]) -> float | None:
    """Total accepted / total drafted tokens (None when nothing was drafted)."""
    drafted = sum(drafted_per_step)
    return sum(accepted_per_step) / drafted if drafted else None


def acceptance_per_position(
    accepted_per_step: Sequence[int], drafted_per_step: Sequence[int], depth: int | None = None
) -> dict[str, list[float | None]]:
    """Per-depth acceptance over the steps that drafted something: ``{"conditional": [...], "cumulative": [...]}``.

    Index i of each list is depth i+1. ``depth`` fixes the list length (default: the deepest accepted depth).
    cumulative[i] = P(accepted >= i+1); conditional[i] = P(accepted >= i+1 | accepted >= i); a conditional
    whose condition never happened is None.
    """
    if len(accepted_per_step) != len(drafted_per_step):
        raise ValueError("accepted_per_step and drafted_per_step must have one entry per step")
    accepted = [a for a, d in zip(accepted_per_step, drafted_per_step) if d > 0]
    depth = depth if depth is not None else max(accepted, default=0)
    reached = [sum(1 for a in accepted if a >= d) for d in range(depth + 1)]  # reached[0] = drafting steps
    cumulative = [reached[d] / reached[0] if reached[0] else None for d in range(1, depth + 1)]
    conditional = [reached[d] / reached[d - 1] if reached[d - 1] else None for d in range(1, depth + 1)]
    return {"conditional": conditional, "cumulative": cumulative}


# Upper edges of the context-length buckets (tokens): <512, 512-2k, 2k-8k, 8k and more.
CONTEXT_BUCKETS: tuple[int, ...] = (512, 2048, 8192)


def context_bucket(length: int) -> str:
    """The bucket label of a context of ``length`` tokens: "<512", "512-2k", "2k-8k" or "8k+"."""
    name = lambda n: f"{n // 1024}k" if n >= 1024 else str(n)  # noqa: E731
    lower = 0
    for upper in CONTEXT_BUCKETS:
        if length < upper:
            return f"<{name(upper)}" if lower == 0 else f"{name(lower)}-{name(upper)}"
        lower = upper
    return f"{name(lower)}+"


def contexts_per_step(prompt_tokens: int, accepted_per_step: Sequence[int]) -> list[int]:
    """The context each step drafted from: the prompt plus every token emitted before it in the turn (a step emits
    its accepted tokens and the target's own one)."""
    contexts, length = [], prompt_tokens
    for accepted in accepted_per_step:
        contexts.append(length)
        length += accepted + 1
    return contexts


def by_context(records: Sequence[dict[str, Any]], depth: int | None = None) -> list[dict[str, Any]] | None:
    """τ, acceptance rate and per-position acceptance per context bucket (buckets without steps left out), from the
    records' ``context_per_step``; None when a record lacks it (written before drafttrain counted contexts)."""
    if not records or any("context_per_step" not in r for r in records):
        return None
    steps: dict[str, tuple[list[int], list[int]]] = {}
    for r in records:
        for ctx, a, d in zip(r["context_per_step"], r["accepted_per_step"], r["drafted_per_step"]):
            accepted, drafted = steps.setdefault(context_bucket(ctx), ([], []))
            accepted.append(a)
            drafted.append(d)
    order = [context_bucket(0), *(context_bucket(edge) for edge in CONTEXT_BUCKETS)]
    return [{"bucket": name, "steps": len(steps[name][0]), "tau": tau(steps[name][0]),
             "acceptance_rate": acceptance_rate(*steps[name]),
             "acceptance_per_position": acceptance_per_position(*steps[name], depth)}
            for name in order if name in steps]


def tokens_per_s(new_tokens: float, seconds: float) -> float | None:
    return new_tokens / seconds if seconds > 0 else None


def speedup(
    method_tokens: Sequence[int], method_seconds: Sequence[float],
    baseline_tokens: Sequence[int], baseline_seconds: Sequence[float],
) -> float | None:
    """Throughput ratio over the whole set: (Σ method tokens / Σ method time) / (Σ baseline tokens / Σ baseline time)."""
    method = tokens_per_s(sum(method_tokens), sum(method_seconds))
    base = tokens_per_s(sum(baseline_tokens), sum(baseline_seconds))
    return method / base if method is not None and base else None


BOOTSTRAP_SAMPLES = 2000


def speedup_interval(
    method_tokens: Sequence[int], method_seconds: Sequence[float],
    baseline_tokens: Sequence[int], baseline_seconds: Sequence[float], level: float = 0.95,
) -> list[float] | None:
    """A ``level`` confidence interval of :func:`speedup`, by resampling the prompts (a percentile bootstrap with a
    fixed seed, so a report is reproducible): how far the figure could move on other prompts like these, and a
    first check that a speedup near 1 is one at all. None for fewer than 2 prompts."""
    if len(method_tokens) < 2:
        return None
    columns = np.array([method_tokens, method_seconds, baseline_tokens, baseline_seconds], dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, columns.shape[1], size=(BOOTSTRAP_SAMPLES, columns.shape[1]))
    sums = columns[:, picks].sum(axis=2)  # [4, samples]
    valid = (sums[1] > 0) & (sums[2] > 0) & (sums[3] > 0)
    ratios = (sums[0][valid] / sums[1][valid]) / (sums[2][valid] / sums[3][valid])
    if not ratios.size:
        return None
    tail = (1 - level) / 2 * 100
    return [round(float(np.percentile(ratios, tail)), 4), round(float(np.percentile(ratios, 100 - tail)), 4)]


def speedup_mean_of_ratios(
    method_tokens: Sequence[int], method_seconds: Sequence[float],
    baseline_tokens: Sequence[int], baseline_seconds: Sequence[float],
) -> float | None:
    """Mean over prompts of (method tokens/s ÷ baseline tokens/s); prompts with a zero throughput are skipped."""
    ratios = []
    for mt, ms, bt, bs in zip(method_tokens, method_seconds, baseline_tokens, baseline_seconds, strict=True):
        method, base = tokens_per_s(mt, ms), tokens_per_s(bt, bs)
        if method is not None and base:
            ratios.append(method / base)
    return sum(ratios) / len(ratios) if ratios else None


def speedup_ratio_of_mean_speeds(
    method_tokens: Sequence[int], method_seconds: Sequence[float],
    baseline_tokens: Sequence[int], baseline_seconds: Sequence[float],
) -> float | None:
    """EAGLE's speed.py: mean over prompts of method tokens/s ÷ mean over prompts of baseline tokens/s."""
    method = [t / s for t, s in zip(method_tokens, method_seconds) if s > 0]
    base = [t / s for t, s in zip(baseline_tokens, baseline_seconds) if s > 0]
    if not method or not base or sum(base) == 0:
        return None
    return (sum(method) / len(method)) / (sum(base) / len(base))


def greedy_match_share(matches: Sequence[bool | None]) -> float | None:
    """Share of prompts whose method tokens equal the baseline's (None when no prompt was compared)."""
    known = [m for m in matches if m is not None]
    return sum(known) / len(known) if known else None


def summarize(records: Sequence[dict[str, Any]], depth: int | None = None) -> dict[str, Any]:
    """The metrics object for a group of per-prompt records (the shape written to report.json).

    Each record needs ``accepted_per_step``, ``drafted_per_step``, ``new_tokens``, ``wall_time_s`` and, when a
    baseline ran, ``baseline_new_tokens``, ``baseline_wall_time_s`` and ``greedy_match`` (None when T > 0).
    """
    accepted = [a for r in records for a in r["accepted_per_step"]]
    drafted = [d for r in records for d in r["drafted_per_step"]]
    method_tokens = [r["new_tokens"] for r in records]
    method_seconds = [r["wall_time_s"] for r in records]
    with_baseline = [r for r in records if r.get("baseline_wall_time_s") is not None]
    base_tokens = [r["baseline_new_tokens"] for r in with_baseline]
    base_seconds = [r["baseline_wall_time_s"] for r in with_baseline]
    paired = bool(records) and len(with_baseline) == len(records)
    return {
        "num_prompts": len(records),
        "tau": tau(accepted),
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "acceptance_per_position": acceptance_per_position(accepted, drafted, depth),
        "tokens_per_s": tokens_per_s(sum(method_tokens), sum(method_seconds)),
        "baseline_tokens_per_s": tokens_per_s(sum(base_tokens), sum(base_seconds)) if with_baseline else None,
        "speedup": speedup(method_tokens, method_seconds, base_tokens, base_seconds) if paired else None,
        "speedup_ci95": speedup_interval(method_tokens, method_seconds, base_tokens, base_seconds) if paired else None,
        "speedup_mean_of_ratios": (
            speedup_mean_of_ratios(method_tokens, method_seconds, base_tokens, base_seconds) if paired else None
        ),
        "speedup_ratio_of_mean_speeds": (
            speedup_ratio_of_mean_speeds(method_tokens, method_seconds, base_tokens, base_seconds) if paired else None
        ),
        "greedy_match": greedy_match_share([r.get("greedy_match") for r in records]),
        "new_tokens": sum(method_tokens),
        "baseline_new_tokens": sum(base_tokens) if with_baseline else None,
        "wall_time_s": sum(method_seconds),
        "baseline_wall_time_s": sum(base_seconds) if with_baseline else None,
        "steps": len(accepted),
        "accepted_tokens": sum(accepted),
        "drafted_tokens": sum(drafted),
        "tokens_per_verification": tokens_per_verification(records),
        "step_ms": step_time_split(records, len(accepted)),
        "by_context": by_context(records, depth),
    }


def tokens_per_verification(records: Sequence[dict[str, Any]]) -> float | None:
    """Mean tokens a verification forward fed (the root, the draft's nodes, a proposer's side tokens): what a step
    costs in the target's width, beside the tokens it gave (τ). None when no step was recorded (or a record was
    written before drafttrain counted them)."""
    fed = [f for r in records for f in r.get("fed_per_step", [])]
    return sum(fed) / len(fed) if fed else None


def step_time_split(records: Sequence[dict[str, Any]], steps: int) -> dict[str, float] | None:
    """Mean milliseconds per speculative step, split into drafting (the proposer), verification (the target's
    forward, the acceptance rule and the cache's rollback, also given alone) and the rest of the loop; the prefills
    are left out."""
    if not steps or any("proposer_time_s" not in r for r in records):
        return None
    draft = sum(r["proposer_time_s"] for r in records)
    verify = sum(r["verify_time_s"] for r in records)
    other = sum(r["wall_time_s"] - r["prefill_time_s"] for r in records) - draft - verify
    rollback = sum(r.get("rollback_time_s", 0.0) for r in records)
    return {"draft": 1e3 * draft / steps, "verify": 1e3 * verify / steps, "other": 1e3 * max(other, 0.0) / steps,
            "rollback": 1e3 * rollback / steps}
