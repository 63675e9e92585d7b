"""``--depth auto`` / ``--tree auto``: how far to draft, chosen from this machine's measured costs and the draft's
measured acceptance.

1. Costs (``measure_costs``): on a prompt, with the target's KV cache prefilled, the seconds of one plain decoding
   step, of one verification forward of w tokens (w = 1 .. D+1), and of the proposer drafting d tokens
   (d = 1 .. D) and consuming an accepted step. On a GPU verification is nearly free up to a few dozen tokens; on
   a CPU an 8-token verification costs about two plain steps, so the best depth differs per machine.
2. Acceptance (``calibrate``): speculative decoding at the maximum depth D on a few calibration prompts (never
   the prompts being reported), recording per step how many tokens were accepted and, per drafted position, the
   draft's top probability.
   The same run times every real decoding cycle (drafting + verification + the loop's bookkeeping), and plain
   decoding through the same loop on every other calibration prompt, interleaved. The cost table is then moved
   onto the loop (``on_the_loop``): the plain step is the loop's own, and a speculative cycle costs the table plus
   the per-cycle overhead the loop measured beyond it. A microbenchmark alone understated both (a 115 ms plain step
   and 23 + 137 ms cycles in the loop, against 12 + 120 ms in the table).
3. Choice (``choose``): for every depth d <= D and confidence threshold t, replay the recorded steps (a chain of
   depth d accepts min(accepted, d); the threshold cuts the chain where the product of top probabilities falls
   below t, exactly as drafttrain.decoding.trees.Chain does), add up tokens and predicted time, and keep the best
   expected speedup over plain decoding, if it beats plain decoding by more than the standard error of the
   calibration's own measured speedup. Depth 0 (plain decoding, speedup 1) is always a candidate, so a draft
   that costs more than it saves is not used.
4. The check while decoding (drafttrain.decoding.guard): a chosen shape comes with a ``RuntimeGuard`` that measures
   the real speedup as the engine decodes, and falls back to a shallower chain or plain decoding when it does not
   pay (``DecodeSettings.runtime_check``).

``choose_shape`` is the one call the evaluator makes: it resolves a side's depth and tree "auto" into settings the
engine takes as they are (or plain decoding, when no shape pays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from drafttrain import DrafttrainError
from drafttrain.config import DecodeSettings
from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.decoding.engine import SpeculativeDecoder
from drafttrain.decoding.guard import RuntimeGuard, measured_speedup
from drafttrain.decoding.proposers import DraftRequest, NoDraft, Proposer
from drafttrain.decoding.trees import (
    Chain,
    StaticTree,
    ancestor_matrix,
    as_shape,
    build_static_tree,
    drafted_depth,
    expected_tree_tokens,
    tree_of,
    tree_position_ids,
)
from drafttrain.sampling import Sampling
from drafttrain.targets import HiddenStateTap, Target, TargetCache, synchronize

log = logging.getLogger(__name__)

CALIBRATION_NEW_TOKENS = 64  # per calibration prompt

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclasses.dataclass
class Costs:
    plain_s: float  # one plain decoding step
    verify_s: list[float]  # [w]: a verification forward of w tokens, w = 0 .. D+1 ([0] unused)
    draft_s: list[float]  # [d]: the proposer drafting d tokens, d = 0 .. D
    accept_s: float  # the proposer consuming one step's accepted tokens
    uncertainty: float = 0.005  # relative standard error of the predicted speedup: a gain below it is not one
    clamped: float = 0.0  # how far the measured table broke physical bounds, in plain steps (then clamped)
    overhead_s: float = 0.0  # what a real decoding cycle costs beyond the table (``on_the_loop``)
    timing_spread: float = 0.0  # relative interquartile range of the table's plain-step timings

    def step_s(self, verify_width: int, drafted_positions: int) -> float:
        """A cycle verifying ``verify_width`` tokens after drafting ``drafted_positions``: never below a plain step
        (a verification forward does at least a plain step's work)."""
        table = self.verify_s[verify_width] + self.draft_s[drafted_positions] + self.accept_s
        return max(self.plain_s, table + self.overhead_s)


@dataclasses.dataclass
class Calibration:
    accepted: list[int]  # per step, at the maximum depth
    confidences: list[list[float]]  # per step, the draft's top probability at each drafted position
    drafted: list[int] = dataclasses.field(default_factory=list)  # per step, the positions drafted
    cycle_s: list[float] = dataclasses.field(default_factory=list)  # per step, the real cycle's wall time
    plain_s: list[float] = dataclasses.field(default_factory=list)  # plain decoding's steps, same loop and prompts

    def measured(self) -> tuple[float, float]:
        """The calibration run's own speedup over plain decoding (at the maximum depth), and its standard error."""
        return measured_speedup([(a + 1, s) for a, s in zip(self.accepted, self.cycle_s)], self.plain_s)


@dataclasses.dataclass
class DepthChoice:
    depth: int
    min_confidence: float
    predicted_speedup: float
    by_depth: dict[int, float]  # predicted speedup of each depth without a threshold
    costs: Costs
    calibration_steps: int
    calibration_measured: float | None = None  # the calibration run's own speedup at the deepest depth

    def summary(self) -> dict:
        return {"depth": self.depth, "min_confidence": self.min_confidence,
                "predicted_speedup": round(self.predicted_speedup, 3),
                "predicted_speedup_by_depth": {d: round(s, 3) for d, s in self.by_depth.items()},
                "plain_step_ms": round(1e3 * self.costs.plain_s, 2),
                "verify_ms": [round(1e3 * s, 2) for s in self.costs.verify_s[1:]],
                "draft_ms": [round(1e3 * s, 2) for s in self.costs.draft_s],
                "cycle_overhead_ms": round(1e3 * self.costs.overhead_s, 2),
                "uncertainty": round(self.costs.uncertainty, 3), "timing_spread": round(self.costs.timing_spread, 3),
                "costs_clamped": self.costs.clamped, "calibration_steps": self.calibration_steps,
                "calibration_measured_speedup": None if self.calibration_measured is None
                else round(self.calibration_measured, 3)}


def timed_call(fn, device: torch.device | str | None = None) -> float:
    """Seconds ``fn()`` takes, the work it queues on ``device`` included (on a GPU the launches return first)."""
    if device is not None:
        synchronize(device)
    start = time.perf_counter()
    fn()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - start


def median_time(fn, repeats: int, device: torch.device | str | None = None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()  # warm-up
    return statistics.median(timed_call(fn, device) for _ in range(repeats))


def prefilled(target: Target, proposer: Proposer, prompt: torch.Tensor):
    """The target's KV cache after ``prompt``, its length, the next (greedy) token, and the proposer prefilled."""
    model = target.model
    cache = TargetCache(model)
    layers = proposer.hidden_layers
    with HiddenStateTap(model, layers) if layers else contextlib.nullcontext() as tap:
        logits = cache.forward(prompt)
        hidden = tap.stacked() if layers else None
    next_token = logits[:, -1:].argmax(-1)
    proposer.prefill(prompt, hidden, next_token)
    return cache, cache.length, next_token, hidden


@torch.inference_mode()
def measure_costs(target: Target, proposer: Proposer, prompt: torch.Tensor, max_depth: int, repeats: int = 5) -> Costs:
    """Seconds per plain step, per verification width and per drafted depth, on ``prompt`` (token ids [1, P])."""
    model, device = target.model, target.device
    cache, prefix, next_token, hidden = prefilled(target, proposer, prompt.to(device))

    widths, depths = range(1, max_depth + 2), range(1, max_depth + 1)
    generator = torch.Generator(device=device).manual_seed(0)
    requests = {d: DraftRequest(Chain(d), Sampling(), generator) for d in depths}  # built outside the timed calls
    verifications = {("verify", w): (lambda w=w: verify_once(model, cache, prefix, next_token, width=w))
                     for w in widths}
    drafts = {("draft", d): (lambda d=d: proposer.propose(requests[d])) for d in depths}
    samples = interleaved_samples({**verifications, **drafts}, repeats, device)
    two = torch.cat([next_token, next_token], dim=1)  # a typical step: one accepted token and the target's own
    step_hidden = None if hidden is None else hidden[:, -2:]
    # last: it grows the draft's cache
    accept_s = median_time(lambda: proposer.accept(two, step_hidden), repeats, device)
    verify_s = [0.0] + [statistics.median(samples[("verify", w)]) for w in widths]
    draft_s = [0.0] + [statistics.median(samples[("draft", d)]) for d in depths]
    spread = interquartile(samples[("verify", 1)]) / verify_s[1]  # relative: how far one timing may be off
    noise = max(interquartile(times) for times in samples.values()) / verify_s[1]
    return physical(Costs(plain_s=verify_s[1], verify_s=verify_s, draft_s=draft_s, accept_s=accept_s,
                          uncertainty=spread, timing_spread=spread), noise)


def interquartile(times: list[float]) -> float:
    """The interquartile range of ``times`` (0 for a single timing)."""
    if len(times) < 2:
        return 0.0
    quartiles = statistics.quantiles(times, n=4)
    return quartiles[2] - quartiles[0]


def on_the_loop(costs: Costs, calibration: Calibration) -> Costs:
    """The table moved onto the decoding loop's own timings: every cost rescaled by the loop's plain step over the
    table's (the table's ratios were measured interleaved, in one phase of the machine; the loop's plain step is
    the phase decoding runs in), then the mean overhead of a real cycle beyond what the rescaled table predicts for
    the same drafts; the uncertainty is the standard error of the calibration's measured speedup (no table without
    the loop's timings is changed).

    Rescaled, not only re-based: prompt lookup's table measured a 1-token verification at 95 ms, the loop's plain
    step 71 ms; kept at 95 ms beside a 71 ms plain step, every cycle was priced 35% too high, and depth 4, measured
    at 1.28x, was predicted at 0.93x (plain decoding chosen).

    The overhead is never negative. Bookkeeping takes no negative time: a loop faster than the rescaled table means
    the microbenchmark's wider verifications ran at a worse moment of a busy machine, and its costs are kept (the
    cautious side). Left negative (-260 ms on a 295 ms plain step, beside a CPU hog), it priced every short cycle at
    a plain step, and a depth-1 chain measured at 0.60x was predicted at 1.20x."""
    if not calibration.cycle_s or not calibration.plain_s:
        return costs
    plain = statistics.median(calibration.plain_s)
    table = rescaled(costs, plain / costs.plain_s)
    predicted = sum(table.verify_s[d + 1] + table.draft_s[d] + table.accept_s for d in calibration.drafted)
    overhead = (sum(calibration.cycle_s) - predicted) / len(calibration.cycle_s)
    if overhead < -0.1 * plain:
        log.warning("depth auto: real decoding cycles ran %.0f%% of a plain step faster than the cost table measured "
                    "(a busy machine?): the table is kept", -100 * overhead / plain)
    overhead = max(0.0, overhead)
    _, se = calibration.measured()
    return dataclasses.replace(table, overhead_s=overhead, uncertainty=se if math.isfinite(se) else costs.uncertainty)


def rescaled(costs: Costs, factor: float) -> Costs:
    """Every cost times ``factor`` (the machine ran that much slower), no overhead."""
    return dataclasses.replace(costs, plain_s=costs.plain_s * factor, verify_s=[v * factor for v in costs.verify_s],
                               draft_s=[d * factor for d in costs.draft_s], accept_s=costs.accept_s * factor,
                               overhead_s=0.0)


def interleaved_samples(fns: dict, repeats: int, device: torch.device | str | None = None) -> dict:
    """``repeats`` timings of every function, taken in rounds (one call of each per round, after one warm-up call
    of each), so that a slow phase of a shared machine falls on all of them alike instead of on one."""
    for fn in fns.values():
        fn()
    samples: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            samples[key].append(timed_call(fn, device))
    return samples


def physical(costs: Costs, noise: float = 0.0) -> Costs:
    """The cost table made physically possible: verifying more tokens never costs less than verifying fewer (nor
    than a plain step), and drafting deeper never less than drafting shallower. Timing noise on a busy machine
    breaks both (verifications measured at 0.47 of a plain step); left as measured, they predict speedups no
    draft can give. ``noise``: the widest interquartile range of the timings, in plain steps; a clamp within it
    is the timing's own spread (an idle machine's neighbouring widths cost nearly alike) and is not warned of."""
    verify = [0.0] + list(itertools.accumulate(costs.verify_s[1:], max))
    draft = list(itertools.accumulate(costs.draft_s, max))
    # how far a cost moved, in plain steps (a microsecond draft's noise is not a busy machine)
    moved = max([abs(a - b) for a, b in zip(verify, costs.verify_s)] + [abs(a - b) for a, b in zip(draft, costs.draft_s)],
                default=0.0) / max(costs.plain_s, 1e-12)
    if moved > max(0.1, noise):
        log.warning("depth auto: measured costs broke physical bounds by up to %.0f%% of a plain step (a busy "
                    "machine?): clamped", 100 * moved)
    return dataclasses.replace(costs, verify_s=verify, draft_s=draft, clamped=round(moved, 3))


class _RecordingProposer(Proposer):
    """Wraps a proposer to record the draft's top probability at each position it drafts (drafters built on
    drafttrain.decoding.expand.TreeDrafter expose them as ``last_confidences``)."""
    def __init__(self, inner: Proposer):
        self.inner, self.name, self.hidden_layers, self.shapes = inner, inner.name, inner.hidden_layers, inner.shapes
        self.confidences: list[list[float]] = []
        inner.record_confidences = True

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.inner.prefill(input_ids, hidden, next_token)

    def propose(self, request):
        draft = self.inner.propose(request)
        self.confidences.append(list(getattr(self.inner, "last_confidences", [1.0] * len(draft))))
        return draft

    def accept(self, tokens, hidden) -> None:
        self.inner.accept(tokens, hidden)


def calibrate(target: Target, proposer: Proposer, prompts: list[torch.Tensor], max_depth: int, max_new_tokens: int,
              stop_token_ids: set[int], sampling: Sampling, seed: int = 0) -> Calibration:
    """Speculative decoding at depth ``max_depth`` on ``prompts``: per step, accepted tokens, confidences, drafted
    positions and the cycle's wall time; and plain decoding's step times through the same loop, on every other
    prompt, just before it (a slow phase of a shared machine falls on both alike)."""
    recorder = _RecordingProposer(proposer)
    warp = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
    decoder = SpeculativeDecoder(target, recorder, depth=max_depth, **warp)
    plain = SpeculativeDecoder(target, NoDraft(), depth=1, **warp)
    calibration = Calibration(accepted=[], confidences=[])
    for index, prompt in enumerate(prompts):
        if index % 2 == 0:
            calibration.plain_s += plain.generate(prompt, max_new_tokens, stop_token_ids).stats.cycle_s
        stats = decoder.generate(prompt, max_new_tokens, stop_token_ids).stats
        calibration.accepted += stats.accepted_per_step
        calibration.drafted += stats.drafted_per_step
        calibration.cycle_s += stats.cycle_s
    calibration.confidences = recorder.confidences[: len(calibration.accepted)]
    return calibration


def drafted_length(confidences: list[float], depth: int, threshold: float) -> int:
    """How many positions a chain of ``depth`` drafts under ``threshold`` (trees.Chain's rule)."""
    chain, product, length = Chain(depth, threshold), 1.0, 0
    for top in confidences[:depth]:
        product *= top
        if chain.stops_at(product):
            break
        length += 1
    return length


def predicted_speedup(costs: Costs, calibration: Calibration, depth: int, threshold: float = 0.0) -> float:
    """Expected throughput of drafting ``depth`` tokens (with ``threshold``) over plain decoding."""
    if depth == 0 or not calibration.accepted:
        return 1.0
    tokens, seconds = 0, 0.0
    for accepted, confidences in zip(calibration.accepted, calibration.confidences):
        length = drafted_length(confidences, depth, threshold)
        tokens += min(accepted, length) + 1
        stopped_early = threshold > 0 and length < depth  # it still paid for the draft forward that revealed it
        seconds += costs.step_s(length + 1, length + 1 if stopped_early else length)
    return (tokens / seconds) * costs.plain_s


def choose(costs: Costs, calibration: Calibration, max_depth: int,
           thresholds: tuple[float, ...] = THRESHOLDS) -> DepthChoice:
    """The depth and threshold with the best predicted speedup; plain decoding (depth 0) when none beats it."""
    by_depth = {d: predicted_speedup(costs, calibration, d) for d in range(max_depth + 1)}
    best = (1.0, 0, 0.0)
    for depth in range(1, max_depth + 1):
        for threshold in thresholds:
            candidate = (predicted_speedup(costs, calibration, depth, threshold), depth, threshold)
            # a real gain, beyond the timing's own spread: otherwise the simpler choice (plain decoding first)
            if candidate[0] > best[0] * (1 + max(0.005, costs.uncertainty)):
                best = candidate
    speedup, depth, threshold = best
    return DepthChoice(depth, threshold, speedup, by_depth, costs, len(calibration.accepted))


# ------------------------------------------------------------------------------------------------ static trees

TREE_SIZES = (2, 4, 8, 16, 24, 32, 48, 64)


@dataclasses.dataclass
class TreeChoice:
    paths: list[list[int]]
    predicted_speedup: float
    by_size: dict[int, float]
    verify_ms: dict[int, float]
    accuracies: list[list[float]]
    plain_s: float = 0.0  # the plain step it was costed against

    @property
    def plain(self) -> bool:
        """No tree pays for its verification on this machine: plain decoding is faster (a weak draft costs
        nothing, as with depth auto's depth 0)."""
        return self.predicted_speedup < 1.0

    def summary(self) -> dict:
        return {"size": len(self.paths), "plain_decoding": self.plain,
                "predicted_speedup": round(self.predicted_speedup, 3),
                "predicted_speedup_by_size": {n: round(s, 3) for n, s in self.by_size.items()},
                "verify_ms": {n: round(ms, 2) for n, ms in self.verify_ms.items()},
                "top1_accuracy_by_depth": [round(row[0], 3) for row in self.accuracies]}


@torch.inference_mode()
def best_tree(target: Target, proposer: Proposer, prompts: list[torch.Tensor], max_new_tokens: int,
                stop_token_ids: set[int], sizes: tuple[int, ...] = TREE_SIZES, repeats: int = 5) -> TreeChoice:
    """The static tree size with the best predicted speedup: trees built from the proposer's measured rank
    accuracies (the Medusa paper's tree tool), each costed by timing its verification forward and its proposal here."""
    accuracies = proposer.rank_accuracies(target, prompts, max_new_tokens, stop_token_ids)
    if accuracies is None:
        raise DrafttrainError(f"tree auto needs a proposer that fills static trees from ranked candidates; "
                              f"{proposer.name!r} does not")
    model = target.model
    cache, prefix, root, _ = prefilled(target, proposer, prompts[0])
    plain = median_time(lambda: verify_once(model, cache, prefix, root), repeats, target.device)
    request = DraftRequest(Chain(1), Sampling(), None)
    by_size, verify_ms, trees = {}, {}, {}
    for size in sizes:
        tree = StaticTree(build_static_tree(accuracies, size))
        request.shape = tree
        draft_s = median_time(lambda: proposer.propose(request), repeats, target.device)
        verify_s = median_time(lambda: verify_once(model, cache, prefix, root, tree), repeats, target.device)
        verify_ms[size] = 1e3 * verify_s
        by_size[size] = expected_tree_tokens(tree.paths, accuracies) * plain / (verify_s + draft_s)
        trees[size] = tree.paths
    best = max(by_size, key=lambda n: (by_size[n], -n))
    return TreeChoice(trees[best], by_size[best], by_size, verify_ms, accuracies, plain)


def verify_once(model, cache, prefix: int, root: torch.Tensor, tree=None, width: int = 1) -> None:
    """One verification forward after the ``prefix`` cached tokens, of the root and ``tree``'s nodes, or without a
    tree of ``width`` tokens (a chain's), then the cache cropped back: a cycle's cost, repeatable on one cache."""
    if tree is None:
        cache.forward(root.expand(1, width).contiguous())
    else:
        ids = root.expand(1, len(tree) + 1).contiguous()
        cache.forward(ids, position_ids=tree_position_ids(tree.parents, prefix, root.device),
                      allowed=ancestor_matrix(tuple(tree.parents)))
    cache.keep(prefix, [])


# ------------------------------------------------------------------------------------------------ the one call


@dataclasses.dataclass
class ShapeChoice:
    """What ``choose_shape`` decided: the proposer to run (NoDraft when plain decoding wins), settings the engine
    takes as they are, and each auto choice's summary for the report (None where nothing was auto)."""
    proposer: Proposer
    settings: DecodeSettings
    depth_auto: dict[str, Any] | None = None
    tree_auto: dict[str, Any] | None = None
    guard: RuntimeGuard | None = None  # the runtime check of an auto choice that speculates

    @property
    def plain(self) -> bool:
        return isinstance(self.proposer, NoDraft)

    def runtime_check(self) -> dict[str, Any] | None:
        """What the runtime check saw and did, for the report (None when it had nothing to check)."""
        return None if self.guard is None else self.guard.summary()


def choose_shape(target: Target, proposer: Proposer, settings: DecodeSettings, calibration: Sequence[str]) -> ShapeChoice:
    """Resolve ``settings``' tree (a spec is parsed) and its depth or tree "auto", chosen for ``proposer`` on this
    machine from the ``calibration`` prompts (first-turn texts, never the reported ones)."""
    tree, depth, min_confidence = tree_of(settings), settings.depth, settings.min_confidence
    choice, checked = ShapeChoice(proposer, settings), None  # checked: (costs, plain step, prediction) of the choice
    if (tree == "auto" or depth == "auto") and proposer.side_tokens:
        raise DrafttrainError(f"depth and tree auto price a verification forward by its draft alone, and the "
                              f"{proposer.name} proposer feeds tokens of its own beside it: give a depth")
    if tree == "auto" or depth == "auto":
        prompts, stops = _calibration_prompts(target, calibration)
        budget = min(settings.max_new_tokens, CALIBRATION_NEW_TOKENS)
        if tree == "auto":  # a static tree sized for this draft and machine (proposers that fill static trees)
            chosen = best_tree(target, proposer, prompts, budget, stops)
            log.info("tree auto: %d nodes, predicted speedup %.2fx (by size: %s)", len(chosen.paths),
                     chosen.predicted_speedup, ", ".join(f"{n}: {s:.2f}" for n, s in chosen.by_size.items()))
            tree, choice.tree_auto = StaticTree(chosen.paths), chosen.summary()
            checked = (None, chosen.plain_s, chosen.predicted_speedup)
            if chosen.plain:  # the best tree still loses to plain decoding here
                choice.proposer, depth, tree = NoDraft(), 1, "chain"
        if depth == "auto":
            chosen = _best_depth(target, choice.proposer, prompts, stops, settings, budget)
            depth, min_confidence, choice.depth_auto = chosen.depth, chosen.min_confidence, chosen.summary()
            checked = (chosen.costs, chosen.costs.plain_s, chosen.predicted_speedup)
            if depth == 0:  # drafting would cost more than it saves: plain decoding
                choice.proposer, depth = NoDraft(), 1
    # the depth it drafts, which a report records: a static tree's own, never a depth set beside it
    choice.settings = DecodeSettings.of(settings, depth=drafted_depth(tree, depth), tree=tree,
                                        min_confidence=min_confidence)
    if checked is not None and not choice.plain and settings.runtime_check:
        costs, plain_s, predicted = checked
        choice.guard = RuntimeGuard(as_shape(tree, depth, min_confidence), costs, plain_s, predicted,
                                    plain_spread=costs.uncertainty if costs is not None else 0.0)
    return choice


def _best_depth(target: Target, proposer: Proposer, prompts: list[torch.Tensor], stops: set[int],
                settings: DecodeSettings, budget: int) -> DepthChoice:
    """Costs measured on the first calibration prompt, acceptance on all of them, and the choice (no deeper than
    the proposer can fill)."""
    deepest = min(settings.max_depth, proposer.max_depth or settings.max_depth)
    with torch.inference_mode():
        table = measure_costs(target, proposer, prompts[0], deepest)
    acceptance = calibrate(target, proposer, prompts, deepest, budget, stops, Sampling(**settings.sampling),
                           settings.seed)
    choice = choose(on_the_loop(table, acceptance), acceptance, deepest)
    choice.calibration_measured = acceptance.measured()[0] if acceptance.plain_s else None
    log.info("depth auto: depth %d, min_confidence %.1f, predicted speedup %.2fx (by depth: %s)", choice.depth,
             choice.min_confidence, choice.predicted_speedup,
             ", ".join(f"{d}: {s:.2f}" for d, s in choice.by_depth.items()))
    return choice


def _calibration_prompts(target: Target, calibration: Sequence[str]) -> tuple[list[torch.Tensor], set[int]]:
    if not calibration:
        raise DrafttrainError("depth or tree auto needs calibration prompts (held out from the reported ones)")
    prompts = [torch.tensor([prompt_ids(target.tokenizer, [{"role": "user", "content": text}])], device=target.device)
               for text in calibration]
    return prompts, set(stop_token_ids(target.tokenizer, target.model.generation_config))
