"""A run's curves as PNG files, without wandb (``drafttrain report RUN``): training loss and accuracy per draft
position, acceptance and held-out accuracy per position over checkpoints, and τ over checkpoints (drafttrain's
evaluator's, the serving engine's, and the one held-out accuracy predicts)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.evaluation.report import save_figure
from drafttrain.runfolder import RunFolder
from drafttrain.training.run_log import read_metrics
from drafttrain.userfiles import make_folder, writing


def _numbered(records: list[dict[str, Any]], pattern: str) -> dict[int, list[tuple[int, float]]]:
    """{k: [(step, value)]} for the keys matching ``pattern`` (one group: k)."""
    series: dict[int, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            match = re.fullmatch(pattern, key)
            if match and value is not None:
                series.setdefault(int(match.group(1)), []).append((record["step"], float(value)))
    return dict(sorted(series.items()))


def _pyplot():
    import matplotlib  # heavy: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    return plt


def plot_training(records: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    steps = [r["step"] for r in records if r.get("loss") is not None]
    left.plot(steps, [r["loss"] for r in records if r.get("loss") is not None], color="black", label="loss")
    left.set_title("training loss")
    for k, points in _numbered(records, r"acc_(\d+)").items():
        right.plot(*zip(*points), label=f"position {k + 1}")
    right.set_title("training top-1 accuracy per draft position")
    right.set_ylim(0, 1)
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


TAUS = (("eval/tau", "τ, drafttrain's evaluator", "o"), ("eval/engine_tau", "τ in vLLM (its counters)", "s"),
        ("eval/agreement_drafttrain_tau", "τ, drafttrain's evaluator on vLLM's prompts", "x"),
        ("eval/sim_tau", "τ predicted by held-out accuracy", "^"))


def plot_checkpoints(evals: list[dict[str, Any]], path: Path) -> None:
    """Left: acceptance per position (drafttrain's evaluator: P(k | k-1); vLLM: the share of drafts whose k-th token
    was accepted) and the held-out top-1 accuracy per position, dashed. Right: every τ measured or predicted."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    measured = {**{f"drafttrain, position {k}": p for k, p in _numbered(evals, r"eval/acceptance_cond_(\d+)").items()},
                **{f"vLLM, position {k}": p for k, p in _numbered(evals, r"eval/engine_acceptance_(\d+)").items()}}
    for label, points in measured.items():
        left.plot(*zip(*points), marker="o", label=label)
    for k, points in _numbered(evals, r"eval/val_acc_(\d+)").items():
        left.plot(*zip(*points), marker=".", linestyle="--", label=f"held-out top-1, position {k + 1}")
    left.set_title("acceptance and held-out accuracy per position" if measured else
                   "held-out accuracy per position over checkpoints")
    left.set_ylim(0, 1)
    for key, label, marker in TAUS:
        points = [(r["step"], r[key]) for r in _merged_by_step(evals) if r.get(key) is not None]
        if points:
            right.plot(*zip(*points), marker=marker, label=label)
    right.set_title("τ (tokens per target step) over checkpoints")
    for ax in (left, right):
        ax.set_xlabel("checkpoint step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def _merged_by_step(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per checkpoint step: a watcher appends its figures for a step in records of their own."""
    merged: dict[int, dict[str, Any]] = {}
    for record in evals:
        merged.setdefault(record["step"], {}).update(record)
    return [merged[step] for step in sorted(merged)]


def write_run_plots(run: RunFolder) -> list[Path]:
    train, evals = read_metrics(run)
    if not train:
        raise DrafttrainError(f"{run.metrics} holds no training records yet")
    out = make_folder(run.plots, "the plots folder")
    written = [out / "training.png"]
    with writing(out, "the plots"):
        plot_training(train, written[0])
        if evals:
            written.append(out / "checkpoints.png")
            plot_checkpoints(evals, written[1])
    return written
