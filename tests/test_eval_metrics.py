"""Metrics on hand-computed inputs, and report writing on a synthetic report (no model needed)."""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain.evaluation import metrics
from drafttrain.evaluation.evaluate import EvalReport
from drafttrain.evaluation.report import REQUIRED_METRIC_KEYS, render_markdown, write_report

# A chain of k=3 over four steps: accepted 2, 0, 3, 1 of 3 drafted each.
ACCEPTED = [2, 0, 3, 1]
DRAFTED = [3, 3, 3, 3]


def test_tau_is_mean_of_accepted_plus_one():
    assert metrics.tau(ACCEPTED) == pytest.approx((3 + 1 + 4 + 2) / 4)  # 2.5
    assert metrics.tau([]) is None


def test_acceptance_rate():
    assert metrics.acceptance_rate(ACCEPTED, DRAFTED) == pytest.approx(6 / 12)
    assert metrics.acceptance_rate([0], [0]) is None


def test_per_position_conditional_vs_cumulative():
    pos = metrics.acceptance_per_position(ACCEPTED, DRAFTED, depth=3)
    # depth 1 reached by 3 of 4 steps, depth 2 by 2, depth 3 by 1
    assert pos["cumulative"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert pos["conditional"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_per_position_ignores_steps_without_a_draft_but_tau_counts_them():
    accepted, drafted = ACCEPTED + [0], DRAFTED + [0]  # prompt lookup found no match on the last step
    assert metrics.acceptance_per_position(accepted, drafted, depth=3) == metrics.acceptance_per_position(
        ACCEPTED, DRAFTED, depth=3
    )
    assert metrics.tau(accepted) == pytest.approx(11 / 5)


def test_per_position_unreached_condition_is_none():
    pos = metrics.acceptance_per_position([0, 0], [2, 2], depth=3)
    assert pos["cumulative"] == [0.0, 0.0, 0.0]
    assert pos["conditional"] == [0.0, None, None]


def test_simulated_tau_reproduces_measured_tau_from_conditionals():
    conditional = metrics.acceptance_per_position(ACCEPTED, DRAFTED, depth=3)["conditional"]
    assert metrics.simulated_tau(conditional) == pytest.approx(metrics.tau(ACCEPTED))
    assert metrics.simulated_tau([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.4)
    assert metrics.simulated_tau([]) == 1.0  # no draft: the target's own token only


def test_both_speedups():
    method_tokens, method_s = [100, 10], [1.0, 0.5]
    base_tokens, base_s = [100, 10], [2.0, 0.25]
    # throughput ratio over the set: (110 / 1.5) / (110 / 2.25)
    assert metrics.speedup(method_tokens, method_s, base_tokens, base_s) == pytest.approx(1.5)
    # per prompt: 100/1 ÷ 100/2 = 2.0 and 10/0.5 ÷ 10/0.25 = 0.5
    assert metrics.speedup_mean_of_ratios(method_tokens, method_s, base_tokens, base_s) == pytest.approx(1.25)
    # EAGLE's speed.py: mean(100, 20) ÷ mean(50, 40)
    assert metrics.speedup_ratio_of_mean_speeds(method_tokens, method_s, base_tokens, base_s) == pytest.approx(
        60 / 45
    )


def test_greedy_match_share_and_expected_acceptance():
    assert metrics.greedy_match_share([True, False, None]) == 0.5
    assert metrics.greedy_match_share([None]) is None
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    assert metrics.expected_acceptance(p, q).item() == pytest.approx(0.7)
    assert metrics.expected_acceptance(p, p).item() == pytest.approx(1.0)
    batch = torch.stack([p, q])
    assert metrics.expected_acceptance(batch, batch.flip(0)).tolist() == pytest.approx([0.7, 0.7])


def _record(qid: str, category: str, accepted, drafted, tokens, seconds, base_seconds, match=True):
    return {
        "question_id": qid, "category": category, "accepted_per_step": accepted, "drafted_per_step": drafted,
        "new_tokens": tokens, "wall_time_s": seconds, "baseline_new_tokens": tokens,
        "baseline_wall_time_s": base_seconds, "greedy_match": match,
    }


RECORDS = [
    _record("1", "writing", [2, 0], [3, 3], 40, 1.0, 2.0),
    _record("2", "writing", [3, 1], [3, 3], 20, 0.5, 0.25, match=False),
    _record("3", "math", [1], [3], 10, 1.0, 1.0),
]


def test_summarize_pools_steps_and_totals():
    s = metrics.summarize(RECORDS, depth=3)
    assert s["num_prompts"] == 3
    assert s["tau"] == pytest.approx((3 + 1 + 4 + 2 + 2) / 5)
    assert s["acceptance_rate"] == pytest.approx(7 / 15)
    assert s["tokens_per_s"] == pytest.approx(70 / 2.5)
    assert s["baseline_tokens_per_s"] == pytest.approx(70 / 3.25)
    assert s["speedup"] == pytest.approx(3.25 / 2.5)
    assert s["speedup_mean_of_ratios"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert s["speedup_ratio_of_mean_speeds"] == pytest.approx((40 + 40 + 10) / (20 + 80 + 10))
    assert s["greedy_match"] == pytest.approx(2 / 3)
    assert s["new_tokens"] == 70 and s["wall_time_s"] == pytest.approx(2.5)
    assert len(s["acceptance_per_position"]["cumulative"]) == 3


def test_summarize_without_baseline_or_at_temperature():
    records = [dict(r, baseline_new_tokens=None, baseline_wall_time_s=None, greedy_match=None) for r in RECORDS]
    s = metrics.summarize(records)
    assert s["speedup"] is None and s["baseline_tokens_per_s"] is None and s["greedy_match"] is None
    assert s["tau"] is not None


def synthetic_report() -> EvalReport:
    config = {
        "target": "t", "proposer": "prompt_lookup", "depth": 3, "tree": "chain", "temperature": 0.0, "top_p": 1.0,
        "suite": "mt_bench", "num_prompts": 3, "num_turns": 3, "max_new_tokens": 16, "seed": 0, "dtype": "float32",
        "device": "cpu", "threads": 2, "versions": {"torch": "x", "transformers": "y", "drafttrain": "z"},
    }
    categories = {c: metrics.summarize([r for r in RECORDS if r["category"] == c], 3) for c in ("writing", "math")}
    return EvalReport(config=config, overall=metrics.summarize(RECORDS, 3), categories=categories,
                      prompts=RECORDS, references={"hf_generate": {"tokens_per_s": 20.0, "speed_vs_baseline": 0.9,
                                                                    "greedy_match_vs_baseline": 1.0}})


def test_write_report_schema_and_files(tmp_path):
    paths = write_report(synthetic_report(), tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    for group in [data["overall"], *data["categories"].values()]:
        assert set(REQUIRED_METRIC_KEYS) <= set(group)
        assert set(group["acceptance_per_position"]) == {"conditional", "cumulative"}
    assert set(data["categories"]) == {"writing", "math"}
    assert {"config", "prompts", "references"} <= set(data)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| **overall** |" in md and "writing" in md and "HF generate" in md


def test_markdown_renders_missing_values_as_dashes():
    report = synthetic_report()
    report.overall["speedup"] = None
    assert "—" in render_markdown(report)


def test_the_speedup_interval_resamples_prompts_and_is_reproducible():
    from drafttrain.evaluation.metrics import speedup, speedup_interval

    tokens, base_s = [64, 64, 60, 64, 64, 50], [3.0, 3.1, 2.4, 2.9, 2.8, 2.1]
    same = speedup_interval(tokens, [s / 1.25 for s in base_s], tokens, base_s)  # every prompt exactly 1.25x
    assert same == [pytest.approx(1.25), pytest.approx(1.25)]
    method_s = [2.5, 2.6, 2.4, 2.7, 2.2, 2.0]
    low, high = speedup_interval(tokens, method_s, tokens, base_s)
    assert low < speedup(tokens, method_s, tokens, base_s) < high and high - low > 0.05
    assert speedup_interval(tokens, method_s, tokens, base_s) == [low, high]  # a fixed seed: the same report twice
    assert speedup_interval(tokens[:1], method_s[:1], tokens[:1], base_s[:1]) is None  # one prompt: no interval


def test_a_busy_machine_is_said_in_one_plain_line(monkeypatch):
    """Wall time far above the CPU time the run got (here: it slept, as a starved process waits), or a load average
    above the cores, marks the run as contended; the report and the console print its note."""
    import os
    import time

    from drafttrain.evaluation import run_info
    from drafttrain.evaluation.report import load_note

    starved = run_info.LoadWatch(load_start=0.0)
    time.sleep(0.3)
    summary = starved.summary()
    assert summary["contended"] and summary["cpu_share"] < run_info.CONTENDED_SHARE
    assert "of the CPU time its" in summary["note"] and "rerun alone" in summary["note"]
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * (os.cpu_count() or 1), 0.0, 0.0))
    loaded = run_info.LoadWatch().summary()
    assert loaded["contended"] and "load average" in loaded["note"]
    assert load_note({"machine_load": loaded}) == loaded["note"] and load_note({}) is None


def test_every_auto_choice_is_reported_with_its_prediction_beside_the_measured_speedup():
    report = synthetic_report()
    fell_back = {"initial": "depth 3", "final": "plain", "cycles": {"depth 3": 24, "plain": 80},
                 "switches": [{"cycle": 24, "from": "depth 3", "to": "plain", "reason": "measured below plain decoding",
                               "measured_speedup": 0.81, "plain_step_ms": 60.0}]}
    report.config.update(depth_auto={"depth": 3, "predicted_speedup": 1.2, "calibration_steps": 40},
                         runtime_check=fell_back,
                         compare=[{"label": "prompt_lookup@auto", "depth_auto": {"depth": 2, "predicted_speedup": 1.3},
                                   "runtime_check": {"switches": [], "last_window_speedup": 1.25}}])
    report.comparisons = {"prompt_lookup@auto": {"tau": 1.5, "acceptance_rate": 0.3, "tokens_per_s": 30.0,
                                                 "speed_vs_baseline": 1.22, "greedy_match_vs_baseline": 1.0}}
    md = render_markdown(report)
    assert "## Auto choices: predicted and measured" in md
    method_row = next(line for line in md.splitlines() if line.startswith("| `prompt_lookup` |"))
    assert "1.20×" in method_row and f"{report.overall['speedup']:.2f}×" in method_row
    assert "depth 3 → plain at cycle 24 (measured 0.81×)" in method_row
    compared = next(line for line in md.splitlines() if line.startswith("| `prompt_lookup@auto` |"))
    assert "1.30×" in compared and "1.22×" in compared and "kept it (last window measured 1.25×)" in compared


def test_an_evaluation_over_its_time_budget_stops_starting_prompts_and_says_so(smollm2):
    from drafttrain.evaluation.evaluate import evaluate

    prompts = ["Name a colour.", "Name a fruit.", "Name a planet."]
    report = evaluate(smollm2, "prompt_lookup", prompts, depth=2, max_new_tokens=4, progress=False, warmup=False,
                      time_budget_s=1e-3)
    budget = report.config["time_budget"]
    assert report.overall["num_prompts"] == 1 and len(report.prompts) == 1  # at least one prompt, then no more
    assert budget["over"] and budget["prompts_measured"] == 1 and budget["prompts_planned"] == 3
    assert "1 of 3 prompts measured" in budget["note"]
    whole = evaluate(smollm2, "prompt_lookup", prompts, depth=2, max_new_tokens=4, progress=False, warmup=False,
                     time_budget_s=600)
    assert whole.overall["num_prompts"] == 3 and not whole.config["time_budget"]["over"]


def test_each_step_sees_the_prompt_and_every_token_emitted_before_it():
    # a step emits its accepted tokens and the target's own one: 100, then 100 + 3, then 103 + 1
    assert metrics.contexts_per_step(100, [2, 0, 4]) == [100, 103, 104]
    assert [metrics.context_bucket(n) for n in (0, 511, 512, 2047, 2048, 8191, 8192)] == \
        ["<512", "<512", "512-2k", "512-2k", "2k-8k", "2k-8k", "8k+"]


def test_acceptance_is_split_by_the_context_length_of_each_step():
    records = [dict(RECORDS[0], context_per_step=[100, 3000]), dict(RECORDS[1], context_per_step=[510, 512]),
               dict(RECORDS[2], context_per_step=[9000])]
    buckets = {b["bucket"]: b for b in metrics.summarize(records, depth=3)["by_context"]}
    assert list(buckets) == ["<512", "512-2k", "2k-8k", "8k+"]  # in order of length
    assert buckets["<512"]["steps"] == 2 and buckets["<512"]["tau"] == pytest.approx((3 + 4) / 2)
    assert buckets["512-2k"]["tau"] == 2 and buckets["2k-8k"]["tau"] == 1 and buckets["8k+"]["tau"] == 2
    assert buckets["<512"]["acceptance_rate"] == pytest.approx(5 / 6)
    assert buckets["<512"]["acceptance_per_position"]["cumulative"] == [1.0, 1.0, 0.5]
    assert metrics.summarize(RECORDS)["by_context"] is None  # records written before contexts were counted


def test_a_report_with_contexts_has_their_table_and_plot(tmp_path):
    report = synthetic_report()
    report.overall["by_context"] = metrics.by_context(
        [dict(r, context_per_step=[600] * len(r["accepted_per_step"])) for r in RECORDS], 3)
    paths = write_report(report, tmp_path / "out")
    md = paths["markdown"].read_text()
    assert "## Acceptance by context length" in md and "| 512-2k | 5 |" in md
    assert paths["context_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "context_plot" not in write_report(synthetic_report(), tmp_path / "plain")
