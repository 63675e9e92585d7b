"""``--depth auto``: the choice follows the measured costs and acceptance; a draft that is never accepted gets depth
0 or 1, one that always is gets the full depth."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from drafttrain.data.chat import prompt_ids
from drafttrain.decoding import Draft, Proposer, autodepth, plain_decode
from drafttrain.decoding.autodepth import (
    Calibration,
    Costs,
    calibrate,
    choose,
    drafted_length,
    measure_costs,
    on_the_loop,
    physical,
    predicted_speedup,
)
from drafttrain.decoding.trees import Chain
from drafttrain.sampling import Sampling

D = 6
# a CPU-like machine: a w-token verification costs 1 + 0.15 (w - 1) plain steps, a draft token 5% of one
CPU = Costs(plain_s=1.0, verify_s=[0.0] + [1 + 0.15 * (w - 1) for w in range(1, D + 2)],
            draft_s=[0.05 * d for d in range(D + 1)], accept_s=0.02)


def test_never_accepted_drafts_get_depth_zero_and_always_accepted_the_full_depth():
    never = Calibration(accepted=[0] * 50, confidences=[[0.05] * D] * 50)
    always = Calibration(accepted=[D] * 50, confidences=[[0.99] * D] * 50)
    assert choose(CPU, never, D).depth == 0 and choose(CPU, never, D).predicted_speedup == 1.0
    choice = choose(CPU, always, D)
    assert choice.depth == D and choice.min_confidence == 0.0
    assert choice.predicted_speedup == pytest.approx((D + 1) / (1 + 0.15 * D + 0.05 * D + 0.02))


def test_a_weak_draft_gets_a_short_chain_and_a_threshold_cuts_unsure_steps():
    # the first token is accepted half the time, deeper ones rarely: a short chain wins on a CPU
    steps = [1, 0] * 25
    weak = Calibration(accepted=steps, confidences=[[0.6, 0.1, 0.1, 0.1, 0.1, 0.1] if a else [0.2] * D
                                                     for a in steps])
    choice = choose(CPU, weak, D)
    assert choice.depth in (1, 2) and choice.by_depth[1] > choice.by_depth[D]
    # the confidence tells the accepted first tokens (0.6) from the rejected ones (0.2): a threshold keeps only those
    assert choice.min_confidence > 0.2 and choice.predicted_speedup > choice.by_depth[1]
    assert drafted_length([0.6, 0.1, 0.9], 3, 0.3) == 1 and drafted_length([0.6, 0.9, 0.9], 3, 0.3) == 3


class Scripted(Proposer):
    """A proposer for the test: drafts the target's own greedy continuation (always accepted) or a token it never
    produces (never accepted), at no cost."""

    name = "scripted"

    def __init__(self, continuation: list[int], right: bool):
        self.continuation, self.right = continuation, right

    def prefill(self, input_ids, hidden, next_token):
        self.device, self.at = input_ids.device, 1  # the first token came from the prefill

    def propose(self, request):
        k = request.shape.depth
        wanted = self.continuation[self.at : self.at + k]
        tokens = wanted if self.right else [(t + 1) % 49152 for t in wanted]
        self.last_confidences = [0.99 if self.right else 0.01] * len(tokens)
        return Draft.chain(torch.tensor([tokens], dtype=torch.long).reshape(1, -1))

    def accept(self, tokens, hidden):
        self.at += tokens.shape[1]


@pytest.mark.slow
def test_auto_depth_on_the_real_target(smollm2, restore_threads):
    torch.set_num_threads(1)
    prompt = torch.tensor([prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name the planets."}])])
    # 48 calibration tokens: 7 cycles of the whole chain, 48 of one token (the decision needs no more; each token
    # of SmolLM2 costs about 0.1 s here, and this test decoded twice as many before)
    budget = 48
    greedy = plain_decode(smollm2, prompt, budget + 8).tokens
    # always accepted: a long chain (the full depth here, but a noisy machine's wider verification may cost a step
    # more, so only "most of the depth" is asserted); never accepted: plain decoding or one token. The timings are
    # this machine's, so the speedup is only required to be a clear win, not a figure.
    for right, depths in ((True, set(range(D // 2, D + 1))), (False, {0, 1})):
        proposer = Scripted(greedy, right)
        costs = measure_costs(smollm2, proposer, prompt, D, repeats=5)
        assert costs.plain_s > 0 and all(s > 0 for s in costs.verify_s[1:])
        calibration = calibrate(smollm2, proposer, [prompt], D, budget, set(), Sampling())
        if right:  # every step accepts the whole chain (a step cut by the token budget may accept fewer)
            assert calibration.accepted[:-1] == [D] * (len(calibration.accepted) - 1)
        else:
            assert sum(calibration.accepted) == 0
        assert len(calibration.cycle_s) == len(calibration.accepted) and calibration.plain_s  # the loop's own timings
        choice = choose(on_the_loop(costs, calibration), calibration, D)
        assert choice.depth in depths, choice.summary()
        # the best of what it measured, up to the margin a deeper chain must win by
        margin = 1 + max(0.005, choice.costs.uncertainty)
        assert choice.predicted_speedup >= max(choice.by_depth.values()) / margin, choice.summary()
        # never accepted: no real gain predicted (with a few % allowed for the timing noise of a shared CPU)
        assert choice.predicted_speedup > 1.5 if right else choice.predicted_speedup <= 1.05, choice.summary()


def test_a_chain_never_drafts_past_its_threshold():
    assert Chain(4, min_confidence=0.5).min_confidence == 0.5
    with pytest.raises(Exception, match="min_confidence"):
        Chain(4, min_confidence=1.0)


def test_a_cost_table_broken_by_noise_is_clamped_to_what_is_physically_possible():
    """A busy machine measured verifications at 0.47-0.75 of a plain step, and depth auto then printed "depth 1,
    predicted 4.95x", which no depth-1 chain can give (at most 2 tokens per target forward, each at least a plain
    step). The table is made monotone first, so a prediction never exceeds depth + 1."""
    noisy = Costs(plain_s=1.0, verify_s=[0.0, 1.0, 0.2, 0.6, 0.5, 1.2, 1.3, 1.4], draft_s=[0.0, 0.1, 0.05, 0.3, 0.3,
                                                                                          0.4, 0.4], accept_s=0.0)
    fixed = physical(noisy)
    assert fixed.verify_s == [0.0, 1.0, 1.0, 1.0, 1.0, 1.2, 1.3, 1.4] and fixed.draft_s[2] == 0.1
    assert fixed.clamped == pytest.approx(0.8)  # verify(2) was measured 0.8 plain steps below what it must cost
    always = Calibration(accepted=[D] * 20, confidences=[[0.99] * D] * 20)
    # a cycle is never priced below a plain step, so even the raw table cannot promise more than depth + 1 now
    assert predicted_speedup(noisy, always, 1) == pytest.approx(2.0)
    for depth in range(1, D + 1):
        assert predicted_speedup(fixed, always, depth) <= depth + 1


def test_a_clamp_within_the_timings_own_spread_is_not_warned_of(caplog):
    """On an idle machine neighbouring verification widths cost nearly alike, and one may time 19% of a plain step
    below the other; that is the timing's spread, not a busy machine. Only a clamp beyond it warns."""
    noisy = Costs(plain_s=1.0, verify_s=[0.0, 1.0, 1.3, 1.11, 1.4], draft_s=[0.0, 0.1, 0.2, 0.3], accept_s=0.0)
    with caplog.at_level("WARNING", logger="drafttrain.decoding.autodepth"):
        assert physical(noisy, noise=0.25).clamped == pytest.approx(0.19)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="drafttrain.decoding.autodepth"):
        physical(noisy, noise=0.05)
    assert "broke physical bounds by up to 19%" in caplog.text


def test_a_gain_inside_the_timings_spread_is_no_gain():
    """Speculation is chosen only when its predicted gain exceeds the measured spread of the timings."""
    steps = [1, 0, 0] * 20
    modest = Calibration(accepted=steps, confidences=[[0.9] * D if a else [0.9] * D for a in steps])
    quiet = choose(CPU, modest, D)
    assert quiet.depth == 1 and 1.0 < quiet.predicted_speedup < 1.2
    noisy = choose(Costs(**{**CPU.__dict__, "uncertainty": 0.25}), modest, D)
    assert noisy.depth == 0 and noisy.predicted_speedup == 1.0


def test_the_cost_table_is_moved_onto_the_decoding_loop():
    """A microbenchmark understated a real cycle (the issue: 12 + 120 ms in the table, 23 + 137 ms in the loop): the
    table gets the loop's plain step and the per-cycle overhead the loop measured beyond it, so that at the
    calibrated depth the prediction is what the loop measured."""
    steps = [1, 0, 2] * 10
    loop = Calibration(accepted=steps, confidences=[[0.9] * D] * len(steps), drafted=[D] * len(steps),
                       cycle_s=[CPU.step_s(D + 1, D) + 0.3] * len(steps), plain_s=[1.05] * 8)
    moved = on_the_loop(CPU, loop)
    table = CPU.verify_s[D + 1] + CPU.draft_s[D] + CPU.accept_s
    assert moved.plain_s == 1.05 and moved.overhead_s == pytest.approx(table + 0.3 - 1.05 * table)
    assert predicted_speedup(moved, loop, D) == pytest.approx(loop.measured()[0])
    assert predicted_speedup(moved, loop, D) < predicted_speedup(CPU, loop, D)  # the table alone promised more
    # a loop faster than the table still never makes a cycle cheaper than a plain step
    fast = on_the_loop(CPU, Calibration(accepted=[0] * 5, confidences=[[0.1] * D] * 5, drafted=[1] * 5,
                                        cycle_s=[0.2] * 5, plain_s=[1.0] * 5))
    assert all(fast.step_s(w + 1, w) >= fast.plain_s for w in range(D + 1))


def test_a_loop_faster_than_a_busy_microbenchmark_keeps_the_table():
    """The quickstart beside a CPU hog: the table said a 2-token verification costs 424 ms, the loop's plain step
    was 295 ms and its depth-8 cycles 260 ms cheaper than the table. A negative overhead priced every short cycle
    at a plain step, so depth 1 was predicted at its tau (1.20x) and measured 0.60x. The table is kept instead."""
    busy = Costs(plain_s=0.304, verify_s=[0.0, 0.304, 0.424, 0.424, 0.424, 0.424, 0.424, 0.551, 0.551, 0.551],
                 draft_s=[0.0, 0.0005, 0.070, 0.070, 0.070, 0.070, 0.183, 0.183, 0.199], accept_s=0.0)
    steps = [0, 1, 0, 0, 2] * 8
    table = busy.verify_s[9] + busy.draft_s[8]
    loop = Calibration(accepted=steps, confidences=[[0.5] * 8] * len(steps), drafted=[8] * len(steps),
                       cycle_s=[table - 0.26] * len(steps), plain_s=[0.295] * 10)
    moved = on_the_loop(busy, loop)
    assert moved.overhead_s == 0.0 and moved.plain_s == 0.295
    assert moved.step_s(2, 1) == pytest.approx((0.424 + 0.0005) * 0.295 / 0.304)  # not the plain step
    # about even (1.4 tokens for 1.39 plain steps, rescaled 3% to the loop), not the 1.20x a negative overhead gave
    assert predicted_speedup(moved, loop, 1) < 1.0 + moved.uncertainty < 1.2
    assert choose(moved, loop, 8).depth == 0


def test_a_table_measured_at_a_slower_moment_is_rescaled_to_the_loop():
    """Prompt lookup on MT-Bench: the table measured a 1-token verification at 95 ms and the loop's plain step at
    71 ms. Re-based onto the loop's plain step but not rescaled, every cycle cost 35% too much, and depth 4,
    measured at 1.28x, was predicted at 0.93x. The table is rescaled by the ratio of the two plain steps, so its
    prediction at the calibrated depth is what the loop measured."""
    slow = Costs(plain_s=1.35 * CPU.plain_s, verify_s=[1.35 * v for v in CPU.verify_s],
                 draft_s=[1.35 * d for d in CPU.draft_s], accept_s=1.35 * CPU.accept_s)
    steps = [2, 0, 4, 1, 0, 6] * 8
    loop = Calibration(accepted=steps, confidences=[[0.5] * D] * len(steps), drafted=[D] * len(steps),
                       cycle_s=[CPU.step_s(D + 1, D)] * len(steps), plain_s=[CPU.plain_s] * 9)
    moved = on_the_loop(slow, loop)
    assert moved.step_s(D + 1, D) == pytest.approx(CPU.step_s(D + 1, D)) and moved.overhead_s == pytest.approx(0)
    assert predicted_speedup(moved, loop, D) == pytest.approx(loop.measured()[0])
    assert choose(moved, loop, D).depth > 0
    # the table only re-based onto the loop's plain step promised less than the loop measured
    assert predicted_speedup(dataclasses.replace(slow, plain_s=CPU.plain_s), loop, D) < 0.8 * loop.measured()[0]


def test_a_timing_waits_for_the_work_its_call_queued_on_the_device(monkeypatch):
    """On a GPU a call returns once its kernels are launched; a timer read then times the launches, and whatever
    waits next is charged for the kernels. Here the device's queue is a stand-in: the call queues 50 ms of work,
    and waiting for the device runs it."""
    queued = []

    def launch() -> None:
        queued.append(0.05)

    def wait_for_device(device) -> None:
        while queued:
            time.sleep(queued.pop())

    monkeypatch.setattr(autodepth, "synchronize", wait_for_device)
    assert autodepth.timed_call(launch, "cuda") >= 0.05
    assert autodepth.timed_call(launch, None) < 0.05  # not told of a device: the launch alone (what it was before)
    queued.clear()
    samples = autodepth.interleaved_samples({"a": launch, "b": lambda: None}, repeats=2, device="cuda")
    assert min(samples["a"]) >= 0.05 and max(samples["b"]) < 0.05  # each call charged for its own work only
    assert autodepth.median_time(launch, 3, "cuda") >= 0.05
