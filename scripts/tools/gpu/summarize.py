"""One table of what scripts/tools/gpu/checks.sh measured, read from the folder it wrote (training logs, plans, step
benchmarks, evaluation reports), so the figures in BENCHMARKS.md come from the files and not from a log scroll.

    python scripts/tools/gpu/summarize.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 2**20


def last_metrics(path: Path) -> dict | None:
    """The last training log row (a checkpoint's evaluation writes rows of its own, without throughput)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "tokens_per_s" in row]
    return rows[-1] if rows else None


def training_rows(out: Path) -> list[str]:
    lines = ["| run | steps | tokens/s | trainable tokens/s | peak reserved MiB | plan total MiB (excl. runtime) | "
             "loss | acc@1 |", "|---|---|---|---|---|---|---|---|"]
    for metrics in sorted(out.glob("*-metrics.jsonl")):
        name = metrics.name.removesuffix("-metrics.jsonl")
        last = last_metrics(metrics)
        if last is None:
            continue
        plan_file = out / f"{name}-plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() and plan_file.stat().st_size else {}
        planned = (plan.get("total", 0) - plan.get("memory", {}).get("runtime", 0)) / MIB if plan else float("nan")
        lines.append(f"| {name} | {last['step']} | {last['tokens_per_s']:.0f} | {last['trainable_tokens_per_s']:.0f} "
                     f"| {last['peak_memory_mib']:.0f} | {planned:.0f} | {last['loss']:.2f} | {last['acc_0']:.3f} |")
    return lines


def step_rows(out: Path) -> list[str]:
    return [f"{path.stem}: {path.read_text().strip()}" for path in sorted(out.glob("step-*.json"))]


def eval_rows(out: Path) -> list[str]:
    lines = ["| eval | device, dtype | tau | speedup (95% CI) | greedy match | tok/s | plain tok/s | draft / verify ms |"
             " compared |", "|---|---|---|---|---|---|---|---|---|"]
    for report_file in sorted(out.glob("*/report.json")):
        report = json.loads(report_file.read_text())
        o, c = report["overall"], report["config"]
        ci = o.get("speedup_ci95") or [float("nan")] * 2
        ms = {k: v or 0.0 for k, v in (o.get("step_ms") or {}).items()}
        compared = "; ".join(f"{name}: tau {side['tau']:.2f}, x{side['speed_vs_baseline']:.2f}, match "
                             f"{side['greedy_match_vs_baseline']}" for name, side in report.get("comparisons", {}).items())
        if o.get("tau") is None or o.get("speedup") is None:  # a run that decoded nothing (a report allows None)
            lines.append(f"| {report_file.parent.name} | no figures: see its report.md |")
            continue
        lines.append(f"| {report_file.parent.name} | {c['machine'].get('cuda') or 'cpu'}, {c['dtype']} | {o['tau']:.3f} "
                     f"| {o['speedup']:.2f} ({ci[0]:.2f}-{ci[1]:.2f}) | {o['greedy_match']} | {o['tokens_per_s']:.1f} | "
                     f"{o['baseline_tokens_per_s']:.1f} | {ms.get('draft', 0):.1f} / {ms.get('verify', 0):.1f} | {compared} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    print("\n".join(training_rows(out) + [""] + step_rows(out) + [""] + eval_rows(out)))


if __name__ == "__main__":
    main()
