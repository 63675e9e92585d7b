"""τ of every side of `drafttrain eval` reports, per context bucket, one panel per run: the options side by
side across runs (each run = the reports of one set of heads, e.g. its MT-Bench and long_context evaluations).

    python scripts/experiments/long_context/plot_context_buckets.py OUT.png "LABEL=REPORT.json[,REPORT.json...]" ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

from drafttrain.evaluation.metrics import CONTEXT_BUCKETS, context_bucket

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

BUCKETS = [context_bucket(0), *(context_bucket(edge) for edge in CONTEXT_BUCKETS)]  # the reports' own labels, in order


def arm_name(checkpoint: str) -> str:
    """RUN/checkpoints/step-N -> RUN's folder name."""
    path = Path(checkpoint)
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.name


def sides_by_bucket(paths: list[str]) -> dict[str, dict[str, float]]:
    """{side: {bucket: τ}} over the reports (the report's own draft is named by its folder, as
    long_context_options.sh names the arms, else by its proposer)."""
    found: dict[str, dict[str, float]] = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        config = report["config"]
        own = arm_name(config["draft"]["path"]) if config.get("draft") else config.get("proposer", "draft")
        sides = [(own, report["overall"]["by_context"])]
        sides += [(name, side["by_context"]) for name, side in report["comparisons"].items()]
        for name, buckets in sides:
            for bucket in buckets:
                found.setdefault(name, {})[bucket["bucket"]] = bucket["tau"]
    return found


def main(out: str, runs: list[str]) -> None:
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs):
        label, paths = run.split("=", 1)
        found = sides_by_bucket(paths.split(","))
        buckets = [b for b in BUCKETS if any(b in per for per in found.values())]
        for name, per in found.items():
            xs = [i for i, b in enumerate(buckets) if b in per]
            ax.plot(xs, [per[buckets[i]] for i in xs], marker="o", label=name)
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("context length at the step (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("τ (tokens per target step)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
