"""What a serving sweep (``drafttrain bench``) concluded, from its report.json alone: the table per concurrency
level, where each draft stops paying, the draft length to serve at each level, and the plot.

Kept here, below export, because a model card shows the same table and plot for the weights the sweep served.
Report layout: ``levels``: [{"concurrency": c, "sides": {side label: {"output_throughput", "speedup", ...}}}];
``sides``: [{"label", "draft", "length"}] in order, the plain side with draft None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drafttrain.config import BenchConfig
from drafttrain.engines.server import PLAIN
from drafttrain.evaluation.report import save_figure

PLOT_NAME = "bench.png"


def draft_sides(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in report["sides"] if s["draft"] is not None]


def margin(report: dict[str, Any], level: dict[str, Any]) -> float:
    """How far above 1 a speedup must be to count at ``level``: the sweep's margin, or plain serving's own spread
    between passes there when it is wider."""
    plain = level["sides"].get(PLAIN) or {}
    passes = plain.get("output_throughput_per_pass") or []
    spread = (max(passes) - min(passes)) / min(passes) if len(passes) > 1 and min(passes) > 0 else 0.0
    return max(report.get("config", {}).get("pays_margin", BenchConfig().pays_margin), spread)


def best_lengths(report: dict[str, Any]) -> dict[str, dict[int, int | None]]:
    """{draft: {concurrency: the draft length with the highest output tokens/s there, None when no length beat
    plain serving by more than the margin}}."""
    out: dict[str, dict[int, int | None]] = {}
    for level in report["levels"]:
        measured: dict[str, list[tuple[float, int]]] = {}
        for side in draft_sides(report):
            speedup = (level["sides"].get(side["label"]) or {}).get("speedup")
            measured.setdefault(side["draft"], [])
            if speedup is not None:
                measured[side["draft"]].append((speedup, side["length"]))
        for draft, candidates in measured.items():
            best = max(candidates, default=None)
            pays = best is not None and best[0] > 1 + margin(report, level)
            out.setdefault(draft, {})[level["concurrency"]] = best[1] if pays else None
    return out


def crossover(report: dict[str, Any]) -> dict[str, int | None | str]:
    """{draft: the highest concurrency up to which it pays at its best length (every lower level paying too);
    "never" when it does not pay at one stream}."""
    out: dict[str, int | None | str] = {}
    for draft, by_level in best_lengths(report).items():
        paying = None
        for concurrency in sorted(by_level):
            if by_level[concurrency] is None:
                break
            paying = concurrency
        out[draft] = "never" if paying is None else paying
    return out


def _fmt(value: Any, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(report: dict[str, Any]) -> list[str]:
    """One row per level and side: throughput, latencies at p50/p95, the engine's acceptance, speedup."""
    lines = ["| concurrency | side | output tok/s | req/s | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) | "
             "ITL p50 / p95 (ms) | acceptance length (drafts) | accepted by position | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for level in report["levels"]:
        for side in report["sides"]:
            m = level["sides"].get(side["label"])
            if m is None:
                continue
            per = ", ".join(f"{p:.2f}" for p in m.get("acceptance_per_position") or []) or "—"
            latency = " | ".join(f"{_fmt(m.get(f'{name}_p50_ms'), 0)} / {_fmt(m.get(f'{name}_p95_ms'), 0)}"
                                 for name in ("ttft", "tpot", "itl"))
            lines.append(f"| {level['concurrency']} | {side['label']} | {_fmt(m.get('output_throughput'))} | "
                         f"{_fmt(m.get('request_throughput'), 2)} | {latency} | {_accepted(m)} | {per} | "
                         f"{_fmt(m.get('speedup'), 2, '×')} |")
    return lines


def _accepted(measured: dict[str, Any]) -> str:
    """τ over the steps that carried a draft, and how many did: an n-gram proposer drafts only where it finds a
    match, so a high τ over few drafts is not a high τ."""
    if measured.get("verify_steps") is None:
        return "—"
    if measured["acceptance_length"] is None:
        return "no drafts (0)"
    return f"{measured['acceptance_length']:.3f} ({measured['verify_steps']:.0f})"


def conclusions(report: dict[str, Any]) -> list[str]:
    """The crossover and the length to serve at each level, a line per draft; then any agreement error."""
    pays = report.get("config", {}).get("pays_margin", BenchConfig().pays_margin)
    lines = [f"A draft pays at a level when its output tokens/s beat plain serving's by more than {pays:.0%} "
             "(or by more than plain serving's spread between passes, when wider)."]
    lengths = best_lengths(report)
    for draft, pays in crossover(report).items():
        lowest = min(lengths[draft])
        where = (f"does not pay even at its lowest level ({lowest} concurrent)" if pays == "never"
                 else f"pays up to concurrency {pays}" if pays != max(lengths[draft]) else
                 f"pays at every level measured (up to {pays})")
        serve = ", ".join(f"{c}: {'off' if k is None else f'k={k}'}" for c, k in sorted(lengths[draft].items()))
        lines.append(f"- **{draft}** {where}; draft length to serve by concurrency: {serve}")
    for error in report.get("errors") or []:
        lines.append(f"- **error:** {error}")
    return lines


def agreement_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("agreement") or []
    if not rows:
        return [f"Agreement with `drafttrain eval`: {report.get('agreement_skipped') or 'not checked'}."]
    lines = ["| side | τ by the engine (concurrency 1) | τ by drafttrain's evaluator | difference | tolerance | "
             "outputs equal to drafttrain's greedy |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['side']} | {_fmt(row['engine_tau'], 3)} | {_fmt(row['drafttrain_tau'], 3)} | "
                     f"{_fmt(row['difference'], 3)} | {row['tolerance']} | {row.get('outputs_equal') or '—'} |")
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> None:
    engine = report["engine"]
    head = [f"# Serving sweep: {engine['name']} {engine.get('version') or ''}".rstrip(),
            "", f"Target `{report['target']}`; {report['prompts']['source']} ({report['prompts']['count']} prompts); "
            f"{report['config']['output_len']} output tokens at most, T={report['config']['temperature']}; "
            f"{report['duration_s'] / 60:.1f} min in all.", ""]
    body = markdown_table(report) + ["", *conclusions(report), "", *agreement_lines(report), "",
                                     f"![speedup and acceptance against concurrency]({PLOT_NAME})"]
    path.write_text("\n".join(head + body) + "\n")


def plot(report: dict[str, Any], path: Path) -> None:
    """Speedup against plain serving (left) and the engine's acceptance length (right) by concurrency, one line
    per draft and length."""
    import matplotlib  # heavy: only when a plot is drawn

    matplotlib.use("Agg")  # headless; no display needed
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = [level["concurrency"] for level in report["levels"]]
    for side in draft_sides(report):
        speedup = [level["sides"].get(side["label"], {}).get("speedup") for level in report["levels"]]
        accept = [level["sides"].get(side["label"], {}).get("acceptance_length") for level in report["levels"]]
        left.plot(levels, [float("nan") if v is None else v for v in speedup], marker="o", label=side["label"])
        right.plot(levels, [float("nan") if v is None else v for v in accept], marker="o", label=side["label"])
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain serving")
    for axis, title in ((left, "output tokens/s against plain serving"), (right, "acceptance length (engine)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent requests")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"{report['engine']['name']} · {Path(str(report['target'])).name}")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
