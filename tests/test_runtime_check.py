"""The runtime check of an auto choice (drafttrain.decoding.guard): it measures the chosen shape against plain decoding
while decoding and falls back when it does not pay; the output stays the target's own."""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_autodepth import Scripted

from drafttrain.config import DecodeSettings
from drafttrain.data.chat import prompt_ids
from drafttrain.decoding import SpeculativeDecoder, plain_decode
from drafttrain.decoding.autodepth import Costs, choose_shape
from drafttrain.decoding.guard import MIN_CYCLES, RETRY_AFTER, Cycle, RuntimeGuard, measured_speedup
from drafttrain.decoding.trees import Chain, StaticTree

D = 4
# a CPU-like table: a w-token verification costs 1 + 0.15 (w - 1) plain steps, a draft token 5% of one
CPU = Costs(plain_s=1.0, verify_s=[0.0] + [1 + 0.15 * (w - 1) for w in range(1, D + 2)],
            draft_s=[0.05 * d for d in range(D + 1)], accept_s=0.0)


def run_cycles(guard: RuntimeGuard, cycles: int, accepted, plain_s: float = 1.0) -> None:
    """Feed the guard ``cycles`` cycles priced by the CPU table (plain steps at ``plain_s``); ``accepted(i)`` gives
    the accepted count of cycle i at the guard's chosen depth."""
    for i in range(cycles):
        shape = guard.next_shape()
        if shape is None:
            guard.observe(None, Cycle(tokens=1, seconds=plain_s, verify_s=plain_s, drafted=0))
            continue
        d = shape.depth
        guard.observe(shape, Cycle(tokens=min(accepted(i), d) + 1, seconds=CPU.step_s(d + 1, d) * plain_s,
                                   verify_s=CPU.verify_s[d + 1] * plain_s, drafted=d))


def test_a_never_accepted_chain_falls_back_to_plain_decoding():
    guard = RuntimeGuard(Chain(D), CPU, plain_s=1.0, predicted=1.3)
    assert guard.start_prompt()
    run_cycles(guard, MIN_CYCLES + 8, accepted=lambda i: 0)
    assert guard.shape is None and guard.next_shape() is None
    event = guard.summary()["switches"][-1]
    assert event["from"] == "depth 4" and event["to"] == "plain" and event["measured_speedup"] < 1


def test_a_draft_that_pays_is_kept_and_a_chain_too_deep_gets_shallower():
    paying = RuntimeGuard(Chain(2), CPU, plain_s=1.0, predicted=1.5)
    run_cycles(paying, 200, accepted=lambda i: 2)  # always accepted: 3 tokens for 1.4 plain steps
    assert paying.shape == Chain(2) and paying.summary()["switches"] == []
    # the first token is always accepted, the rest never: depth 1 pays more than depth 4
    deep = RuntimeGuard(Chain(D), CPU, plain_s=1.0, predicted=1.3)
    run_cycles(deep, 200, accepted=lambda i: 1)
    assert deep.shape == Chain(1), deep.summary()
    assert deep.summary()["switches"][0]["reason"] == "a shallower chain pays more"


def test_noise_around_a_small_gain_does_not_flip_the_choice():
    """A draft with a modest real gain, timed with ±20% noise per cycle: one standard error is the margin, so the
    guard keeps it (a test of the decision rule, not of a figure)."""
    noise = iter(torch.rand(10_000, generator=torch.Generator().manual_seed(0)).tolist())
    guard = RuntimeGuard(Chain(1), CPU, plain_s=1.0, predicted=1.2)
    for _ in range(400):
        shape = guard.next_shape()
        jitter = 0.8 + 0.4 * float(next(noise))
        if shape is None:
            guard.observe(None, Cycle(tokens=1, seconds=jitter, verify_s=jitter, drafted=0))
        else:
            guard.observe(shape, Cycle(tokens=2 if float(next(noise)) < 0.6 else 1, seconds=1.2 * jitter,
                                       verify_s=1.15 * jitter, drafted=1))
    assert guard.shape == Chain(1), guard.summary()  # 1.6 tokens per 1.2 plain steps: about 1.33x


def test_after_a_fallback_speculation_is_tried_again_later_with_a_longer_wait():
    guard = RuntimeGuard(Chain(D), CPU, plain_s=1.0, predicted=1.3)
    guard.start_prompt()
    run_cycles(guard, MIN_CYCLES + 8, accepted=lambda i: 0)
    assert guard.shape is None and not guard.start_prompt()  # the next prompt decodes plainly
    run_cycles(guard, RETRY_AFTER, accepted=lambda i: 0)
    assert guard.start_prompt() and guard.shape == Chain(D)  # tried again
    run_cycles(guard, MIN_CYCLES + 8, accepted=lambda i: 0)
    assert guard.shape is None
    run_cycles(guard, RETRY_AFTER, accepted=lambda i: 0)
    assert not guard.start_prompt() and guard.retry_after == 2 * RETRY_AFTER  # the wait doubled


def test_plain_decoding_is_re_measured_while_speculating():
    """The plain step the guard compares against is measured in the loop now and then, not only at calibration:
    a machine that became 3x slower for everything changes nothing, a draft that became slow is seen."""
    guard = RuntimeGuard(Chain(2), CPU, plain_s=1.0, predicted=1.5)
    run_cycles(guard, 300, accepted=lambda i: 2, plain_s=3.0)
    summary = guard.summary()
    assert summary["plain_step_ms"] == pytest.approx(3000.0) and summary["switches"] == []
    assert summary["cycles"]["plain"] >= 300 // 40  # a probe every PROBE_EVERY cycles


def test_measured_speedup_and_its_standard_error():
    ratio, se = measured_speedup([(2, 1.0)] * 10, [1.0] * 5)
    assert ratio == pytest.approx(2.0) and se == pytest.approx(0.0)
    few, se_few = measured_speedup([(2, 1.0), (1, 1.0)] * 4, [1.0, 1.2])
    many, se_many = measured_speedup([(2, 1.0), (1, 1.0)] * 400, [1.0, 1.2] * 100)
    assert few == pytest.approx(many) == pytest.approx(1.65) and se_many < se_few / 5
    assert measured_speedup([], [1.0])[1] == math.inf


def test_a_tree_has_no_shallower_candidate_only_plain_decoding():
    tree = StaticTree([[0], [1], [0, 0]])
    guard = RuntimeGuard(tree, None, plain_s=1.0, predicted=1.2)
    for _ in range(MIN_CYCLES + 8):
        shape = guard.next_shape()
        guard.observe(shape, Cycle(tokens=1, seconds=1.0, verify_s=1.0, drafted=0) if shape is None
                      else Cycle(tokens=1, seconds=1.3, verify_s=1.2, drafted=2))
    assert guard.shape is None and guard.summary()["switches"][0]["from"] == "static tree (3 nodes)"


class Slowed(Scripted):
    """The scripted draft with a delay per draft once ``slow`` is set (a draft whose cycle became slow after the
    auto choice, as when another job starts on the machine)."""

    def __init__(self, continuation, right, delay_s: float):
        super().__init__(continuation, right)
        self.delay_s, self.slow = delay_s, False

    def propose(self, request):
        if self.slow:
            time.sleep(self.delay_s)
        return super().propose(request)


@pytest.mark.slow
def test_on_the_real_target_a_never_accepted_draft_falls_back_and_greedy_output_is_the_targets(smollm2):
    prompt = torch.tensor([prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name the planets."}])])
    new_tokens = 4 * MIN_CYCLES  # the guard decides after MIN_CYCLES one-token cycles: most of the answer comes after
    greedy = plain_decode(smollm2, prompt, new_tokens).tokens
    step = min(plain_decode(smollm2, prompt, 8).stats.cycle_s)
    guard = RuntimeGuard(Chain(D), None, plain_s=step, predicted=1.3)
    decoder = SpeculativeDecoder(smollm2, Scripted(greedy, right=False), depth=D, guard=guard)
    out = decoder.generate(prompt, new_tokens)
    assert out.tokens == greedy
    assert guard.shape is None, guard.summary()
    # after the fallback every step is a plain one: nothing drafted
    fallback_at = guard.summary()["switches"][0]["cycle"]
    assert out.stats.drafted_per_step[fallback_at:] == [0] * (len(out.stats.drafted_per_step) - fallback_at)
    # the next prompt is decoded plainly too, with the same output
    assert decoder.generate(prompt, new_tokens).tokens == greedy


@pytest.mark.slow
def test_on_the_real_target_a_draft_slowed_after_the_choice_is_dropped(smollm2):
    """Depth auto chooses an always-accepted draft; then every draft takes twenty plain steps (an injected delay:
    the plain step is measured once, quiet, and a test worker beside this one can slow the real steps two or three
    times, so eight were not always slower than plain decoding). The runtime check sees the slow cycles and falls
    back; the output is still the target's own."""
    prompt = torch.tensor([prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name the planets."}])])
    greedy = plain_decode(smollm2, prompt, 160).tokens
    step = min(plain_decode(smollm2, prompt, 8).stats.cycle_s)
    proposer = Slowed(greedy, right=True, delay_s=20 * step)
    choice = choose_shape(smollm2, proposer, DecodeSettings(depth="auto", max_depth=D, max_new_tokens=160),
                          ["Name the planets."])
    assert choice.guard is not None and choice.settings.depth >= 2, choice.depth_auto
    proposer.slow = True
    decoder = SpeculativeDecoder(smollm2, choice.proposer, choice.settings, guard=choice.guard)
    assert decoder.generate(prompt, 160).tokens == greedy
    assert choice.guard.shape is None, choice.guard.summary()


@pytest.mark.slow
def test_on_the_real_target_a_slow_draft_makes_the_auto_choice_plain_decoding(smollm2):
    """A draft that is always right but takes six plain steps per draft: the auto choice, timed on real decoding
    cycles, does not speculate."""
    prompt = torch.tensor([prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name the planets."}])])
    greedy = plain_decode(smollm2, prompt, 100).tokens
    step = min(plain_decode(smollm2, prompt, 8).stats.cycle_s)
    proposer = Slowed(greedy, right=True, delay_s=6 * step)
    proposer.slow = True
    choice = choose_shape(smollm2, proposer, DecodeSettings(depth="auto", max_depth=D, max_new_tokens=100),
                          ["Name the planets."])
    assert choice.plain and choice.guard is None, choice.depth_auto
