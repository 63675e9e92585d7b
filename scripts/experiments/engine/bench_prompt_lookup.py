#!/usr/bin/env python
"""Prompt lookup on SmolLM2-135M: our engine vs our plain decode vs HF ``generate`` (greedy, and with
``prompt_lookup_num_tokens``), on MT-Bench first turns, all in one process on the same prompts.

    python scripts/experiments/engine/bench_prompt_lookup.py --num-prompts 12 --max-new-tokens 128 --threads 1 --json bench.json

The four sides run one after the other on each prompt, the starting side rotating from prompt to prompt (see
drafttrain.evaluation.evaluate), after one uncounted warm-up of each. HF's prompt lookup gets the same draft
length k and the same maximum n-gram size as ours, so the comparison is between engines, not settings.
Speeds are throughput ratios over the whole set (Σ tokens / Σ wall time, prefill included). On a shared CPU
the figures are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=12, help="first N MT-Bench questions, first turn only")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="draft length (prompt_lookup_num_tokens for HF)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and the full report here")
    return parser.parse_args(argv)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def bench_rows(report) -> list[dict[str, Any]]:
    """One row per side: tokens/s, speed vs our plain decode and vs HF greedy, τ (HF's estimated from its
    counted target forwards)."""
    o, refs = report.overall, report.references
    hf_greedy = refs["hf_generate"]["tokens_per_s"]
    hf_pl = refs["hf_prompt_lookup"]
    sides = [
        ("ours: plain decode", o["baseline_tokens_per_s"], 1.0, 1.0),
        (f"ours: prompt lookup (k={report.config['depth']})", o["tokens_per_s"], o["tau"], o["greedy_match"]),
        ("HF generate greedy", hf_greedy, refs["hf_generate"]["tau_estimate"],
         refs["hf_generate"]["greedy_match_vs_baseline"]),
        (f"HF generate prompt_lookup_num_tokens={report.config['depth']}", hf_pl["tokens_per_s"],
         hf_pl["tau_estimate"], hf_pl["greedy_match_vs_baseline"]),
    ]
    return [
        {"side": name, "tokens_per_s": tps, "vs_our_plain": _ratio(tps, o["baseline_tokens_per_s"]),
         "vs_hf_greedy": _ratio(tps, hf_greedy), "tau": tau, "greedy_match_vs_our_plain": match}
        for name, tps, tau, match in sides
    ]


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def markdown(rows: list[dict[str, Any]], report) -> str:
    c = report.config
    lines = [
        f"{c['target']} · MT-Bench first turns · {c['num_prompts']} prompts · {c['max_new_tokens']} new tokens · "
        f"{c['threads']} threads · {c['machine']['cpu_count']} CPUs · torch {c['versions']['torch']} · "
        f"transformers {c['versions']['transformers']}",
        "",
        "| side | tok/s | vs our plain | vs HF greedy | τ (HF: estimate) | greedy match vs our plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['side']} | {_fmt(r['tokens_per_s'], '{:.2f}')} | {_fmt(r['vs_our_plain'], '{:.2f}×')} | "
            f"{_fmt(r['vs_hf_greedy'], '{:.2f}×')} | {_fmt(r['tau'], '{:.2f}')} | "
            f"{_fmt(r['greedy_match_vs_our_plain'], '{:.0%}')} |"
        )
    ours, hf = rows[1]["tokens_per_s"], rows[3]["tokens_per_s"]
    lines += ["", f"ours vs HF prompt lookup: {_fmt(_ratio(ours, hf), '{:.2f}×')} "
                  f"(speedup over our plain, mean of per-prompt ratios: "
                  f"{_fmt(report.overall['speedup_mean_of_ratios'], '{:.2f}×')})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from drafttrain.evaluation import evaluate, load_suite
    from drafttrain.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prompts = load_suite("mt_bench").select(args.num_prompts, turns="1")
    report = evaluate(target, "prompt_lookup", prompts, depth=args.k, max_new_tokens=args.max_new_tokens,
                      seed=args.seed, hf_reference=True)
    rows = bench_rows(report)
    print(markdown(rows, report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "report": report.to_dict()}, indent=2) + "\n")
    return 0 if report.greedy_match == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
