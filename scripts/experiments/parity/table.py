"""The EAGLE-3 comparison's tables, from what scripts/experiments/parity/eagle3.sh wrote under OUT.

    python scripts/experiments/parity/table.py OUT

One row per trainer and seed: optimizer steps, training seconds and tokens per second (each trainer's own clock),
held-out top-1 per position (heldout.json), τ and speedup by our evaluator on MT-Bench and on the held-out prompts
(eval-*/report.json: one interleaved run per prompt set), and τ by vLLM for the drafts it served (serving-*).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ours(out: Path, name: str) -> dict:
    """drafttrain's steps and training seconds from its last checkpoint's trainer state; tokens per second as the
    mean of its logged windows (metrics.jsonl)."""
    run = out / name
    state = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                        / "trainer_state.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"tokens_per_s"' in line]
    return {"steps": state["step"], "train_s": state["train_seconds"],
            "tokens_per_s": f"{sum(r['tokens_per_s'] for r in records) / len(records):.0f}"}


def reference(out: Path, name: str) -> dict:
    """A reference's steps and training seconds from its run record. speculators logs its tokens; SpecForge does
    not, so its rate is its rows (4 a step) at the run's mean row length: approximate, marked ≈."""
    run = json.loads((out / name / "run.json").read_text())
    if "tokens" in run:
        return {"steps": run["steps_logged"], "train_s": run["train_seconds"],
                "tokens_per_s": f"{run['tokens'] / run['train_seconds']:.0f}"}
    lengths = json.loads((out / "features" / "rows.json").read_text())["train_lengths"]
    tokens = run["steps_logged"] * 4 * sum(lengths) / len(lengths)
    return {"steps": run["steps_logged"], "train_s": run["train_seconds"],
            "tokens_per_s": f"≈{tokens / run['train_seconds']:.0f}"}


def evaluated(report: Path) -> dict[str, tuple[float, float]]:
    """label -> (τ, speedup) of every draft in one evaluation run; the report's own draft is "first"."""
    data = json.loads(report.read_text())
    sides = {"first": (data["overall"]["tau"], data["overall"]["speedup"])}
    sides.update({label: (c["tau"], c["speed_vs_baseline"]) for label, c in data["comparisons"].items()})
    return sides


def served(out: Path, trainer: str) -> str:
    path = out / f"serving-{trainer}" / "serving_check.json"
    if not path.exists():
        return "—"
    check = json.loads(path.read_text())
    theirs = next(iter(check["vllm"].values()))
    return f"{check['drafttrain']['tau']:.3f} / {theirs['tau']:.3f}" if "tau" in theirs else "error"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    heldout = json.loads((out / "heldout.json").read_text())["drafts"]
    evals = {name: evaluated(out / f"eval-{name}" / "report.json") for name in ("mt_bench", "heldout")
             if (out / f"eval-{name}" / "report.json").exists()}
    print("| side | steps | training s | tokens/s | held-out top-1, steps 1-3 | MT-Bench τ, speedup | "
          "held-out prompts τ, speedup | ours / vLLM τ (8 MT-Bench × 64) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, name in enumerate(heldout):
        trainer = name.rsplit("-s", 1)[0]
        facts = ours(out, name) if trainer.startswith("drafttrain") else reference(out, name)
        top1 = ", ".join(f"{a:.3f}" for a in heldout[name]["top1_per_position"])
        cells = []
        for sides in evals.values():
            tau, speed = sides["first" if i == 0 else name]
            cells.append(f"{tau:.3f}, {speed:.2f}×")
        vllm = served(out, trainer) if name.endswith("-s0") else "—"
        print(f"| {name} | {facts['steps']} | {facts['train_s']:.0f} | {facts['tokens_per_s']} | {top1} | "
              f"{' | '.join(cells)} | {vllm} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
