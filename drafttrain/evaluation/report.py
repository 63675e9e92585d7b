"""Write an :class:`EvalReport`: ``report.json`` (machine-readable), ``report.md`` (tables), ``acceptance.png``
(per-position acceptance) and a rich table on the console. No generated text is ever written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from drafttrain.evaluation.evaluate import EvalReport
from drafttrain.runfolder import write_atomic, write_text_atomic
from drafttrain.userfiles import writing

# Keys every metrics object (overall and each category) carries in report.json.
REQUIRED_METRIC_KEYS: tuple[str, ...] = (
    "tau", "acceptance_rate", "acceptance_per_position", "tokens_per_s", "baseline_tokens_per_s", "speedup",
    "speedup_mean_of_ratios", "greedy_match", "num_prompts", "new_tokens", "wall_time_s",
)

REFERENCE_LABELS = {
    "hf_generate": "HF generate (plain)",
    "hf_prompt_lookup": "HF generate, prompt lookup",
    "hf_assisted": "HF generate, assisted (draft model), our draft length",
    "hf_assisted_default": "HF generate, assisted (draft model), HF's default schedule and confidence stop",
}

DEFINITIONS = """\
- **τ**: mean tokens per target verification forward, bonus included (mean over steps of accepted + 1);
  EAGLE's "average acceptance length". The prefill forward is not a step.
- **acceptance rate**: accepted / drafted tokens (a tree step counts the depth of its deepest path as drafted).
- **per-position**: over steps that drafted; cumulative = P(depth d accepted), conditional = P(depth d | depth d-1).
- **speedup**: (Σ method tokens / Σ method time) ÷ (Σ baseline tokens / Σ baseline time), wall clock with prefill;
  **mean of ratios**: mean over prompts of per-prompt throughput ratios; **EAGLE speed.py**: mean per-prompt
  method tokens/s ÷ mean per-prompt baseline tokens/s (SafeAILab/EAGLE's convention).
- **τ (estimate)** for HF lines: Σ new tokens / Σ target forwards (counted with a hook; HF verifies its first
  draft inside the prefill forward, so every forward emits accepted + 1 tokens).
- **greedy match**: share of prompts whose tokens equal the baseline's at T=0 (a lossless engine gives 1.0).
"""


ACCEPTANCE_PLOT = "acceptance.png"
CONTEXT_PLOT = "context.png"


def write_report(report: EvalReport, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and acceptance.png into ``out_dir`` (created); return their paths. Each file is
    written whole or not at all; a full disk or a read-only folder is one line."""
    out = Path(out_dir)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "plot": out / ACCEPTANCE_PLOT}
    with writing(out, "the evaluation report", after="; make room and evaluate again"):
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(paths["json"], report.to_json() + "\n")
        write_text_atomic(paths["markdown"], render_markdown(report))
        plot_acceptance(report, paths["plot"])
        if report.overall.get("by_context"):
            paths["context_plot"] = out / CONTEXT_PLOT
            plot_by_context(report, paths["context_plot"])
    return paths


def save_figure(fig, path: str | Path, dpi: int) -> None:
    """A figure as a PNG, written whole under its name or not at all (a full disk leaves no half image); closed."""
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    try:
        write_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _metric_row(name: str, m: dict[str, Any]) -> list[str]:
    return [
        name, str(m["num_prompts"]), fmt(m["tau"]), _pct(m["acceptance_rate"]), fmt(m["tokens_per_s"], 1),
        fmt(m["baseline_tokens_per_s"], 1), fmt(m["speedup"], 2, "×"), fmt(m["speedup_mean_of_ratios"], 2, "×"),
        _pct(m["greedy_match"]), str(m["new_tokens"]), fmt(m["wall_time_s"], 1),
    ]


METRIC_HEADER = [
    "group", "prompts", "τ", "acceptance", "tok/s", "baseline tok/s", "speedup", "speedup (mean of ratios)",
    "greedy match", "new tokens", "wall s",
]


# Fewer, shorter columns so that the console table fits 80 columns (report.md has them all).
CONSOLE_HEADER = ["group", "n", "τ", "accept", "tok/s", "base tok/s", "speedup", "mean-ratio", "greedy"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _config_line(c: dict[str, Any]) -> str:
    tree = c["tree"] if isinstance(c["tree"], str) else c["tree"].get("kind", "tree")
    if c.get("tree_auto"):
        auto = c["tree_auto"]
        tree = f"static, {auto['size']} nodes (auto: predicted {auto['predicted_speedup']:.2f}x on this machine)"
        if auto.get("plain_decoding"):
            tree = (f"none: plain decoding (auto: the best tree, {auto['size']} nodes, predicted "
                    f"{auto['predicted_speedup']:.2f}x on this machine)")
    return (
        f"target `{c['target']}`{_trained_for_text(c)} · proposer `{c['proposer']}` · depth {_depth_text(c)} · tree {tree} · "
        f"T={c['temperature']} top_p={c['top_p']} · suite `{c['suite']}` ({c['num_prompts']} prompts, "
        f"{c['num_turns']} turns) · max_new_tokens {c['max_new_tokens']} · seed {c['seed']} · "
        f"{c['dtype']} on {c['device']}, {c['threads']} threads{_kernel_text(c)} · torch {c['versions']['torch']}, "
        f"transformers {c['versions']['transformers']}, drafttrain {c['versions']['drafttrain']}"
    )


def _trained_for_text(c: dict[str, Any]) -> str:
    trained_for = (c.get("draft") or {}).get("trained_for")
    return f" (the draft was trained for `{trained_for}`)" if trained_for and trained_for != c["target"] else ""


def _kernel_text(c: dict[str, Any]) -> str:
    kernels = c.get("cpu_linear") or {}
    return f", {kernels['packed_layers']} linear layers packed (oneDNN)" if kernels.get("packed_layers") else ""


def _depth_text(c: dict[str, Any]) -> str:
    text = str(c["depth"])
    if c.get("min_confidence"):
        text += f", stop below confidence {c['min_confidence']:g}"
    auto = c.get("depth_auto")
    if auto:
        text += (f" (auto: depth {auto['depth']} predicted {auto['predicted_speedup']:.2f}x on this machine from "
                 f"{auto['calibration_steps']} held-out steps)")
    return text


def auto_choices(report: EvalReport) -> list[dict[str, Any]]:
    """Every side whose shape was chosen by depth or tree auto: what it chose, the speedup it predicted, the speedup
    the run measured against the same baseline, and what the runtime check did."""
    c = report.config
    sides = [(c["proposer"], c, report.overall.get("speedup"))]
    sides += [(side["label"], side, (report.comparisons.get(side["label"]) or {}).get("speed_vs_baseline"))
              for side in c.get("compare") or ()]
    rows = []
    for label, side, measured in sides:
        depth, tree = side.get("depth_auto"), side.get("tree_auto")
        if not depth and not tree:
            continue
        auto = depth or tree
        chose = (f"depth {auto['depth']}" if depth else f"static tree, {auto['size']} nodes")
        if (depth and auto["depth"] == 0) or (tree and auto.get("plain_decoding")):
            chose = "plain decoding"
        rows.append({"side": label, "chose": chose, "predicted": auto["predicted_speedup"], "measured": measured,
                     "runtime_check": runtime_text(side.get("runtime_check"))})
    return rows


def runtime_text(check: dict[str, Any] | None) -> str:
    """What the runtime check of an auto choice did, in a few words."""
    if not check:
        return "—"
    if not check["switches"]:
        window = check.get("last_window_speedup")
        return "kept it" + (f" (last window measured {window:.2f}×)" if window is not None else "")
    moves = [f"{e['from']} → {e['to']} at cycle {e['cycle']}"
             + (f" (measured {e['measured_speedup']:.2f}×)" if "measured_speedup" in e else f" ({e['reason']})")
             for e in check["switches"]]
    return "; ".join(moves)


def speedup_text(overall: dict[str, Any]) -> str | None:
    """"speedup 1.13× (95% interval over prompts 1.06–1.21×)", where a baseline ran."""
    if overall.get("speedup") is None:
        return None
    interval = overall.get("speedup_ci95")
    spread = f" (95% interval over prompts {interval[0]:.2f}–{interval[1]:.2f}×)" if interval else ""
    return f"speedup {overall['speedup']:.2f}×{spread}"


def mismatch_text(report: EvalReport) -> str | None:
    """Each side's greedy mismatches and how many of them the target's own rounding explains (None: none)."""
    sides = [("the method", report.overall.get("greedy_mismatches"))]
    sides += [(f"`{k}`", v.get("greedy_mismatches")) for k, v in report.comparisons.items()]
    counted = [(name, m) for name, m in sides if m and m["prompts"]]
    if not counted:
        return None
    return ("greedy mismatches, judged by the target at each prompt's first one (drafttrain.evaluation.rounding): "
            + "; ".join(f"{name} {m['prompts']} prompt(s), {m['rounding']} within the target's own rounding "
                        "(a near-tie its one-token and verification-wide forwards order differently)"
                        if m["rounding"] == m["prompts"] else
                        f"{name} {m['prompts']} prompt(s), {m['prompts'] - m['rounding']} NOT explained by rounding"
                        for name, m in counted))


def load_note(config: dict[str, Any]) -> str | None:
    """The one plain line a report gets when the machine was busy while it measured."""
    return (config.get("machine_load") or {}).get("note")


def render_markdown(report: EvalReport) -> str:
    parts = ["# drafttrain eval\n", _config_line(report.config) + "\n", "## Results\n"]
    rows = [_metric_row("**overall**", report.overall)]
    rows += [_metric_row(name, m) for name, m in report.categories.items()]
    parts.append(_table(METRIC_HEADER, rows))
    parts.append(
        f"\nSpeedup as SafeAILab/EAGLE's speed.py computes it (ratio of mean per-prompt speeds): "
        f"{fmt(report.overall.get('speedup_ratio_of_mean_speeds'), 2, '×')}\n"
    )
    for line in (speedup_text(report.overall), load_note(report.config), mismatch_text(report)):
        if line:
            parts.append(f"\n{line[0].upper()}{line[1:]}.\n")
    split = report.overall.get("step_ms")
    if split:
        parts.append(f"\nTime per speculative step: drafting {split['draft']:.1f} ms, verification "
                     f"{split['verify']:.1f} ms (of which the cache's rollback {split.get('rollback', 0.0):.2f} ms), "
                     f"the rest of the loop {split['other']:.1f} ms.\n")
    parts.append("\n## Per-position acceptance (overall)\n")
    pos = report.overall["acceptance_per_position"]
    parts.append(_table(
        ["depth", "conditional P(d given d-1)", "cumulative P(d)"],
        [[str(i + 1), _pct(c), _pct(u)] for i, (c, u) in enumerate(zip(pos["conditional"], pos["cumulative"]))],
    ))
    if report.overall.get("by_context"):
        parts.append("\n## Acceptance by context length (overall)\n")
        parts.append(context_table(report.overall["by_context"]))
        others = {k: v["by_context"] for k, v in report.comparisons.items() if v.get("by_context")}
        if others:
            parts.append("\nOther proposers, same prompts, τ by context length: " + "; ".join(
                f"`{k}` " + ", ".join(f"{b['bucket']} {fmt(b['tau'])}" for b in buckets)
                for k, buckets in others.items()) + ".\n")
    autos = auto_choices(report)
    if autos:
        parts.append("\n## Auto choices: predicted and measured on this machine, same run\n")
        parts.append(_table(
            ["side", "chose", "predicted speedup", "measured speedup", "runtime check"],
            [[f"`{a['side']}`", a["chose"], fmt(a["predicted"], 2, "×"), fmt(a["measured"], 2, "×"),
              a["runtime_check"]] for a in autos],
        ))
    if report.references:
        parts.append("\n## Hugging Face references (not our numbers)\n")
        parts.append(_table(
            ["reference", "tok/s", "speed vs our baseline", "greedy match vs our baseline", "τ (estimate)"],
            [[REFERENCE_LABELS.get(k, k), fmt(v["tokens_per_s"], 1), fmt(v["speed_vs_baseline"], 2, "×"),
              _pct(v["greedy_match_vs_baseline"]), fmt(v.get("tau_estimate"))]
             for k, v in report.references.items()],
        ))
    if report.comparisons:
        parts.append("\n## Other proposers, same prompts, same run\n")
        parts.append(_table(
            ["proposer", "τ", "acceptance", "tok/s", "speedup vs the same baseline", "greedy match"],
            [[f"`{k}`", fmt(v["tau"]), _pct(v["acceptance_rate"]), fmt(v["tokens_per_s"], 1),
              fmt(v["speed_vs_baseline"], 2, "×"), _pct(v["greedy_match_vs_baseline"])]
             for k, v in report.comparisons.items()],
        ))
    if report.original_target:
        o = report.original_target
        parts.append("\n## The adapted target against the original (adapters off), same prompts, same run\n")
        parts.append(_table(
            ["original target tok/s", "its speed vs the adapted target's plain decoding",
             "greedy match, adapted vs original", "method speedup vs the original's plain decoding"],
            [[fmt(o["tokens_per_s"], 1), fmt(o["speed_vs_baseline"], 2, "×"), _pct(o["greedy_match_vs_baseline"]),
              fmt(o["method_speedup_vs_original"], 2, "×")]],
        ))
    parts.append("\n## Definitions\n\n" + DEFINITIONS)
    return "\n".join(parts)


def plot_acceptance(report: EvalReport, path: str | Path) -> None:
    """Two panels (conditional, cumulative) of acceptance by depth: one line per category, overall in bold."""
    import matplotlib  # heavy: only when a plot is drawn

    matplotlib.use("Agg")  # headless; no display needed
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True, constrained_layout=True)
    panels = (("conditional", "conditional: P(depth d | depth d-1 accepted)"),
              ("cumulative", "cumulative: P(depth d accepted)"))
    groups = list(report.categories.items()) if len(report.categories) > 1 else []
    for ax, (key, title) in zip(axes, panels):
        for name, m in groups:
            _plot_line(ax, m["acceptance_per_position"][key], label=name, linewidth=1.2, alpha=0.75)
        _plot_line(ax, report.overall["acceptance_per_position"][key], label="overall", linewidth=2.8,
                   color="black")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft depth d")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance")
    c = report.config
    suite = Path(str(c["suite"])).name  # a custom file's name, not its whole path
    fig.suptitle(f"{c['proposer']} on {c['target']} · {suite} · τ = {fmt(report.overall['tau'])}", fontsize=11)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # outside the axes: with 8 MT-Bench categories a legend inside would hide lines
        fig.legend(handles, labels, fontsize=8, loc="outside right upper")
    save_figure(fig, path, dpi=120)


def context_table(buckets: list[dict[str, Any]]) -> str:
    """Markdown: steps, τ, acceptance and conditional acceptance per depth for each context bucket."""
    depth = max(len(b["acceptance_per_position"]["conditional"]) for b in buckets)
    return _table(
        ["context (tokens)", "steps", "τ", "acceptance", *(f"P(d{k} given d{k - 1})" for k in range(1, depth + 1))],
        [[b["bucket"], str(b["steps"]), fmt(b["tau"]), _pct(b["acceptance_rate"]),
          *(_pct(c) for c in b["acceptance_per_position"]["conditional"])] for b in buckets],
    )


def context_line(buckets: list[dict[str, Any]] | None) -> str | None:
    """One console line: τ per context bucket with its number of steps."""
    if not buckets:
        return None
    return "τ by context length: " + ", ".join(f"{b['bucket']} {fmt(b['tau'])} ({b['steps']} steps)" for b in buckets)


def plot_by_context(report: EvalReport, path: str | Path) -> None:
    """Two panels: τ per context bucket (the method, and every compared proposer that drafted), and the method's
    conditional acceptance by depth, one line per bucket."""
    import matplotlib  # heavy: only when a plot is drawn

    matplotlib.use("Agg")  # headless; no display needed
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    sides = {report.config.get("proposer", "method"): report.overall["by_context"],
             **{k: v["by_context"] for k, v in report.comparisons.items() if v.get("by_context")}}
    for name, buckets in sides.items():
        left.plot([b["bucket"] for b in buckets], [b["tau"] for b in buckets], marker="o", label=name)
    left.set_title("τ (tokens per target step) by context length", fontsize=10)
    left.set_xlabel("context length at the step (tokens)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    for b in report.overall["by_context"]:
        _plot_line(right, b["acceptance_per_position"]["conditional"], label=f"{b['bucket']} ({b['steps']} steps)")
    right.set_title("conditional acceptance by depth, per context bucket", fontsize=10)
    right.set_xlabel("draft depth d")
    right.set_ylim(0, 1.02)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def _plot_line(ax, values: list[float | None], **style) -> None:
    points = [(i + 1, v) for i, v in enumerate(values) if v is not None]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=4, **style)
        ax.set_xticks(range(1, len(values) + 1))


def print_report(report: EvalReport, console=None) -> None:
    """A rich table of overall and per-category metrics (plus HF reference lines) on the console."""
    console = console or Console()
    console.print(_config_line(report.config), style="dim")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, name in enumerate(CONSOLE_HEADER):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=len(name))
    width = len(CONSOLE_HEADER)
    table.add_row(*_metric_row("overall", report.overall)[:width], style="bold")
    for name, m in report.categories.items():
        table.add_row(*_metric_row(name, m)[:width])
    console.print(table)
    pos = report.overall["acceptance_per_position"]
    console.print(
        "per-position acceptance (conditional / cumulative): "
        + "  ".join(f"d{i + 1} {_pct(c)} / {_pct(u)}" for i, (c, u) in enumerate(zip(pos["conditional"],
                                                                                     pos["cumulative"])))
    )
    if speedup_text(report.overall):
        console.print(speedup_text(report.overall))
    if context_line(report.overall.get("by_context")):
        console.print(context_line(report.overall["by_context"]))
    if load_note(report.config):
        console.print(f"NOTE: {load_note(report.config)}", style="bold yellow")
    if mismatch_text(report):
        console.print(f"NOTE: {mismatch_text(report)}", style="bold yellow")
    split = report.overall.get("step_ms")
    if split:
        console.print(f"per step: drafting {split['draft']:.1f} ms, verification {split['verify']:.1f} ms (rollback "
                      f"{split.get('rollback', 0.0):.2f} ms), other {split['other']:.1f} ms")
    for auto in auto_choices(report):
        console.print(f"auto choice of {auto['side']}: {auto['chose']}, predicted {fmt(auto['predicted'], 2, '×')}, "
                      f"measured {fmt(auto['measured'], 2, '×')}; runtime check: {auto['runtime_check']}")
    for key, line in report.comparisons.items():
        console.print(
            f"same run, proposer {key}: τ {fmt(line['tau'])}, acceptance {_pct(line['acceptance_rate'])}, "
            f"{fmt(line['tokens_per_s'], 1)} tok/s, speedup {fmt(line['speed_vs_baseline'], 2, '×')}, "
            f"greedy match {_pct(line['greedy_match_vs_baseline'])}"
        )
    if report.original_target:
        o = report.original_target
        console.print(f"original target (adapters off): greedy match with the adapted target "
                      f"{_pct(o['greedy_match_vs_baseline'])}, method speedup against its plain decoding "
                      f"{fmt(o['method_speedup_vs_original'], 2, '×')}")
    for key, line in report.references.items():
        console.print(
            f"reference {REFERENCE_LABELS.get(key, key)}: {fmt(line['tokens_per_s'], 1)} tok/s, "
            f"{fmt(line['speed_vs_baseline'], 2, '×')} our baseline, τ≈{fmt(line.get('tau_estimate'))} (not our numbers)"
        )
