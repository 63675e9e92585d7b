"""Measuring speculative decoding: question suites, metrics, the ``evaluate()`` library API and reports.

>>> from drafttrain.evaluation import evaluate, load_suite, write_report
>>> report = evaluate(target, "prompt_lookup", load_suite("mt_bench").select(8), depth=5, max_new_tokens=128)
>>> report.overall["tau"], report.overall["speedup"], report.greedy_match
"""

from drafttrain.evaluation.evaluate import EvalReport, evaluate
from drafttrain.evaluation.metrics import (
    acceptance_per_position,
    acceptance_rate,
    expected_acceptance,
    simulated_tau,
    speedup,
    speedup_mean_of_ratios,
    summarize,
    tau,
)
from drafttrain.evaluation.report import REQUIRED_METRIC_KEYS, print_report, render_markdown, write_report
from drafttrain.evaluation.suites import BUILTIN_SUITES, Question, Suite, load_suite

__all__ = [
    "BUILTIN_SUITES",
    "EvalReport",
    "Question",
    "REQUIRED_METRIC_KEYS",
    "Suite",
    "acceptance_per_position",
    "acceptance_rate",
    "evaluate",
    "expected_acceptance",
    "load_suite",
    "print_report",
    "render_markdown",
    "simulated_tau",
    "speedup",
    "speedup_mean_of_ratios",
    "summarize",
    "tau",
    "write_report",
]
