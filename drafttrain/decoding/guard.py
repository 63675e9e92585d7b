"""The runtime check of an auto choice: while decoding, measure what the chosen shape gives against plain decoding
on the machine as it is now, and fall back (to a shallower chain, or to plain decoding) when it does not pay.

Why: depth and tree auto predict from a short calibration. The calibration prompts may accept better than the
served ones, and a shared machine changes under a run (another job starts). A tool that sells speed must not make
decoding slower by its own choice, so the choice is checked where it matters, in the decoding loop.

What it measures:
* every speculative cycle: the tokens it emitted and its wall time (drafting + verification + bookkeeping);
* plain decoding's step time, re-measured now and then: every ``PROBE_EVERY`` cycles one cycle drafts nothing
  (a plain step through the same loop; the proposer still consumes its token), and after a fallback every step is
  a plain step. Until the first probe, the calibration's own plain-step timing stands in.

What it decides, every ``CHECK_EVERY`` cycles once ``MIN_CYCLES`` are in the window: the measured speedup
R = tokens / seconds x plain step. A chain's shallower depths are predicted from the same cycles (a chain of depth
d' accepts min(accepted, d') and costs what the calibration's cost table says a depth-d' cycle costs relative to
this one); plain decoding is R = 1. The guard moves to the best candidate when it beats the current shape by more
than one standard error of R (delta method over the window's cycles and the plain timings). A fallback to plain
decoding holds for the rest of the prompt (the proposer is no longer fed); speculation is tried again at a later
prompt, after ``RETRY_AFTER`` plain steps, a wait that doubles after every retry that falls back again.

Losslessness is untouched: each cycle is an ordinary speculative step with some draft (possibly empty), and the
shape of a cycle depends only on earlier cycles, never on the draw that verifies it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from drafttrain.decoding.trees import Chain, DynamicTree, StaticTree

PROBE_FIRST = 4  # speculative cycles before the first plain probe (the calibration's plain timing stands in until)
PROBE_EVERY = 32  # speculative cycles between plain probes after that
MIN_CYCLES, CHECK_EVERY = 16, 8  # cycles in the window before a decision, and between decisions
WINDOW = 64  # the latest cycles of the current shape that a decision reads (a machine that changes is seen)
RETRY_AFTER = 64  # plain steps after a fallback before speculation is tried again (doubled after each failed retry)
PLAIN_WINDOW = 16  # the latest plain-step timings kept


@dataclasses.dataclass
class Cycle:
    """One turn of the decoding loop, as the engine timed it."""
    tokens: int  # accepted + the target's own token
    seconds: float  # the whole cycle: drafting, verification, the proposer's bookkeeping
    verify_s: float  # the verification forward and acceptance alone (a plain step's cost when nothing was drafted)
    drafted: int  # chain length / deepest tree path (0: a plain step)

    @property
    def accepted(self) -> int:
        return self.tokens - 1


def measured_speedup(cycles: list[tuple[int, float]], plain: list[float],
                     plain_spread: float = 0.0) -> tuple[float, float]:
    """(R, se of log R): the speedup over plain decoding of cycles given as (tokens, seconds), against plain-step
    timings ``plain``, and its standard error by the delta method (R is a ratio of means: tokens per cycle over
    seconds per cycle over seconds per plain step). ``plain_spread``: the relative error of the plain step to use
    when fewer than two timings of it exist."""
    n = len(cycles)
    if n == 0 or not plain:
        return 1.0, math.inf
    tokens = [float(t) for t, _ in cycles]
    seconds = [s for _, s in cycles]
    t_mean, s_mean, p_mean = statistics.fmean(tokens), statistics.fmean(seconds), statistics.fmean(plain)
    ratio = t_mean / s_mean * p_mean
    if n < 2:
        return ratio, math.inf
    var_t, var_s = statistics.variance(tokens), statistics.variance(seconds)
    cov = sum((a - t_mean) * (b - s_mean) for a, b in zip(tokens, seconds)) / (n - 1)
    var_log = (var_t / t_mean**2 + var_s / s_mean**2 - 2 * cov / (t_mean * s_mean)) / n
    var_plain = statistics.variance(plain) / (len(plain) * p_mean**2) if len(plain) > 1 else plain_spread**2
    return ratio, math.sqrt(max(var_log, 0.0) + var_plain)


def shape_label(shape) -> str:
    if shape is None:
        return "plain"
    if isinstance(shape, Chain):
        return f"depth {shape.depth}" + (f" (confidence {shape.min_confidence:g})" if shape.min_confidence else "")
    if isinstance(shape, StaticTree):
        return f"static tree ({len(shape)} nodes)"
    if isinstance(shape, DynamicTree):
        return f"dynamic tree ({shape.total_tokens} nodes)"
    return type(shape).__name__


class RuntimeGuard:
    """Chooses the shape of every cycle of a SpeculativeDecoder (which calls ``start_prompt``, ``next_shape`` and
    ``observe``) from what the cycles measure. ``costs`` is the auto choice's cost table (``step_s(width, drafted)``),
    used only to predict shallower chains; ``plain_s`` the calibration's plain step; ``predicted`` its prediction."""

    def __init__(self, shape, costs, plain_s: float, predicted: float, plain_spread: float = 0.0):
        self.chosen, self.costs = shape, costs
        self.calibrated_plain_s, self.plain_spread, self.predicted = plain_s, plain_spread, predicted
        self.restart()

    def restart(self) -> None:
        """Back to the chosen shape with nothing measured (after a warm-up run, whose first calls are slow)."""
        self.shape = self.last_shape = self.chosen
        self.plain: list[float] = []  # the latest plain-step timings, measured in this loop
        self.window: list[Cycle] = []  # cycles of the current shape since it was chosen
        self.since_probe, self.since_check, self.plain_steps, self.retry_after = 0, 0, 0, RETRY_AFTER
        self.events: list[dict[str, Any]] = []
        self.cycles: dict[str, int] = {}
        self.total = 0

    # -- the engine's side ---------------------------------------------------------------------------------------
    def start_prompt(self) -> bool:
        """A new prompt: whether it speculates (the engine then prefills the proposer). After a fallback, it tries
        the last speculative shape again once enough plain steps have passed."""
        if self.shape is None and self.plain_steps >= self.retry_after:
            self._switch(self.last_shape, "retry after a fallback", None)
            self.retry_after *= 2
        return self.shape is not None

    def next_shape(self):
        """The next cycle's shape; None for a plain step (a probe, or everything after a fallback)."""
        if self.shape is None:
            return None
        if self.since_probe >= (PROBE_FIRST if not self.plain else PROBE_EVERY):
            return None
        return self.shape

    def observe(self, shape, cycle: Cycle) -> None:
        self.total += 1
        label = shape_label(shape)
        self.cycles[label] = self.cycles.get(label, 0) + 1
        if shape is None:
            self.plain = (self.plain + [cycle.verify_s])[-PLAIN_WINDOW:]
            self.since_probe = 0
            self.plain_steps += self.shape is None
            return
        self.since_probe += 1
        self.since_check += 1
        self.window = (self.window + [cycle])[-WINDOW:]
        if len(self.window) >= MIN_CYCLES and self.since_check >= CHECK_EVERY:
            self.since_check = 0
            self._check()

    # -- the decision ----------------------------------------------------------------------------------------------
    def plain_timings(self) -> list[float]:
        return self.plain or [self.calibrated_plain_s]

    def measured(self) -> tuple[float, float]:
        """The current shape's measured speedup over the window, and its standard error (of log R)."""
        return measured_speedup([(c.tokens, c.seconds) for c in self.window], self.plain_timings(),
                                self.plain_spread)

    def _check(self) -> None:
        current, se = self.measured()
        candidates = {None: 1.0, **self._shallower()}
        best = max(candidates, key=lambda s: (candidates[s], s is None))
        if candidates[best] > current * math.exp(se):
            self._switch(best, "measured below plain decoding" if best is None else "a shallower chain pays more",
                         current, candidates[best])

    def _shallower(self) -> dict:
        """Predicted speedups of shallower chains, from the window's cycles (only a chain has them)."""
        if not isinstance(self.shape, Chain) or self.costs is None:
            return {}
        plain_s = statistics.fmean(self.plain_timings())
        out = {}
        for depth in range(1, self.shape.depth):
            tokens = seconds = 0.0
            for c in self.window:
                cut = min(c.drafted, depth)
                tokens += min(c.accepted, cut) + 1
                seconds += c.seconds * self.costs.step_s(cut + 1, cut) / self.costs.step_s(c.drafted + 1, c.drafted)
            out[Chain(depth, self.shape.min_confidence)] = tokens / seconds * plain_s
        return out

    def _switch(self, shape, reason: str, measured: float | None, predicted: float | None = None) -> None:
        event = {"cycle": self.total, "from": shape_label(self.shape), "to": shape_label(shape), "reason": reason,
                 "plain_step_ms": round(1e3 * statistics.fmean(self.plain_timings()), 2)}
        if measured is not None:
            event["measured_speedup"] = round(measured, 3)
        if predicted is not None:
            event["predicted_speedup"] = round(predicted, 3)
        self.events.append(event)
        if shape is not None:
            self.last_shape = shape
        else:
            self.plain_steps = 0
        self.shape, self.window, self.since_probe, self.since_check = shape, [], 0, 0

    def summary(self) -> dict[str, Any]:
        """For the report: where it started and ended, every switch, and what it measured."""
        measured, se = self.measured() if self.window else (None, None)
        return {"initial": self.events[0]["from"] if self.events else shape_label(self.shape),
                "final": shape_label(self.shape), "switches": self.events, "cycles": dict(self.cycles),
                "plain_step_ms": round(1e3 * statistics.fmean(self.plain_timings()), 2),
                "calibrated_plain_step_ms": round(1e3 * self.calibrated_plain_s, 2),
                "last_window_speedup": None if measured is None else round(measured, 3),
                "last_window_se": None if se is None or math.isinf(se) else round(se, 3)}
