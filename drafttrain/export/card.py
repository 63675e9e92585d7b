"""The model card (README.md) of an export: Hub metadata, the measured eval table, how to serve it, the recipe.

Every figure in the card comes from an eval report that measured these weights (drafttrain.export.writer checks
the weights' sha256); without one the card says that nothing was measured rather than showing a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData

from drafttrain import __version__
from drafttrain.drafts.codecs import Exported, codecs_of
from drafttrain.engines.server import ENGINES
from drafttrain.evaluation.report import CONTEXT_PLOT, context_table
from drafttrain.evaluation.serving_report import PLOT_NAME as BENCH_PLOT
from drafttrain.evaluation.serving_report import agreement_lines, conclusions, markdown_table
from drafttrain.targets.loading import provenance

DEPTH_DEFAULT = 3  # speculative tokens in the serving snippets when nothing was measured



def build_card(drafter, fmt: str, exported: Exported, measured: dict[str, Any] | None,
               recipe: dict[str, Any] | None, plot: str | None, bench: dict[str, Any] | None = None) -> ModelCard:
    target = drafter.target
    facts = provenance(target)
    sources = [s.get("path") for s in ((recipe or {}).get("data") or {}).get("sources", [])]
    hub_datasets = [s for s in sources if s and s.count("/") == 1 and not Path(s).expanduser().exists()]
    data = ModelCardData(
        base_model=facts["base_model"], license=facts["license"], library_name="drafttrain",
        pipeline_tag="text-generation", datasets=hub_datasets or None,
        tags=["speculative-decoding", drafter.kind, fmt, *codecs_of(type(drafter))[fmt].serving(drafter)],
    )
    depth = _served_depth(drafter, measured)
    sections = [
        f"# {drafter.kind} draft for {facts['base_model'] or target.name}",
        f"A speculative-decoding draft ({drafter.description}) for **{target.name}**, trained and measured with "
        f"drafttrain {__version__}, written in the **{fmt}** format. "
        "Speculative decoding with it is lossless: the target verifies every drafted token, so greedy output is "
        "the target's own, and sampling follows the target's distribution.",
        "## Measured",
        _measured_section(measured, plot),
        *(["## Served across concurrency", _bench_section(bench)] if bench is not None else []),
        "## Serve it",
        _serving(drafter, fmt, facts["base_model"] or target.name, depth),
    ]
    if exported.notes:
        sections += ["## Format notes", "\n".join(f"- {n}" for n in exported.notes)]
    sections += ["## Files", _files_text(exported, fmt)]
    if recipe is not None:
        sections += ["## How it was trained", "The recipe, as drafttrain validated it:",
                     "```yaml\n" + yaml.safe_dump(recipe, sort_keys=False).strip() + "\n```"]
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)



def _served_depth(drafter, measured) -> int:
    if measured is not None and isinstance(measured["config"].get("depth"), int) and measured["config"]["depth"] > 0:
        return measured["config"]["depth"]
    limit = drafter.max_draft_depth(drafter.config)
    return limit or DEPTH_DEFAULT


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _num(value, digits=2, suffix="") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _measured_section(measured: dict[str, Any] | None, plot: str | None) -> str:
    if measured is None:
        return ("Not measured: this checkpoint has no evaluation report. Run `drafttrain eval --draft ...` and "
                "export again with `--report` to put the measured table here.")
    c, o = measured["config"], measured["overall"]
    machine = c.get("machine") or {}
    hardware = machine.get("cuda") or f"CPU ({machine.get('cpu_count')} cores, {c.get('threads')} threads)"
    tree = c.get("tree") if c.get("tree") not in (None, "chain") else f"chain, depth {c.get('depth')}"
    lines = [
        "| suite | prompts | temperature | draft shape | τ (tokens per target step) | acceptance | speedup vs "
        "plain decoding | greedy match | hardware |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {Path(str(c['suite'])).name} | {o['num_prompts']} | {c['temperature']} | {tree} | {_num(o['tau'])} | "
        f"{_pct(o['acceptance_rate'])} | {_num(o.get('speedup'), 2, '×')} | {_pct(o.get('greedy_match'))} | "
        f"{hardware}, {c.get('dtype')} |",
        "",
        "Acceptance per draft position (conditional: accepted given the previous one was; cumulative: accepted):",
        "",
    ]
    per = o["acceptance_per_position"]
    positions = range(1, len(per["conditional"]) + 1)
    lines += ["| position | " + " | ".join(str(k) for k in positions) + " |",
              "|---" * (len(per["conditional"]) + 1) + "|",
              "| conditional | " + " | ".join(_pct(v) for v in per["conditional"]) + " |",
              "| cumulative | " + " | ".join(_pct(v) for v in per["cumulative"]) + " |"]
    if plot is not None:
        lines += ["", f"![acceptance per position]({plot})"]
    if o.get("by_context"):
        lines += ["", "By the context length each drafting step saw (prompt and history, plus the answer so far):", "",
                  context_table(o["by_context"])]
        if plot is not None:
            lines += ["", f"![acceptance by context length]({CONTEXT_PLOT})"]
    lines += ["", f"Measured {c.get('started_at')} with drafttrain {c.get('versions', {}).get('drafttrain')}: "
                  "speculative and plain decoding of the same prompts, interleaved in one process. The full report "
                  "is `eval/report.json`."]
    return "\n".join(lines)


def _bench_section(bench: dict[str, Any]) -> str:
    engine, c = bench["engine"], bench["config"]
    lines = [f"`drafttrain bench` served the target in {engine['name']} {engine.get('version') or ''}, plainly and "
             f"with this draft, on {bench['prompts']['source']} ({c['output_len']} new tokens at most, "
             f"T={c['temperature']}), at {', '.join(map(str, c['concurrency']))} concurrent requests. Acceptance "
             "comes from the engine's own counters, differenced around each level; speedup is output tokens/s "
             f"against plain serving at the same level. Measured {bench['started_at']}.", "",
             *markdown_table(bench), "", *conclusions(bench), "", *agreement_lines(bench), "",
             f"![speedup and acceptance against concurrency]({BENCH_PLOT})", "",
             "The sweep's report is `bench/report.json`."]
    return "\n".join(lines)


def _serving(drafter, fmt: str, target: str, depth: int) -> str:
    """The engine's command for the draft in this format, then what the kind says a user serving it must know."""
    return _command(drafter, fmt, target, depth) + "".join(f"\n\n{note}" for note in drafter.card_notes())


def _command(drafter, fmt: str, target: str, depth: int) -> str:
    """Each engine's command for the draft in this format, as the format's codec says the engine serves it."""
    served = "THIS_REPO/target" if drafter.adapts_target else target
    commands = [ENGINES[engine].card_command(serving, served, depth)
                for engine, serving in codecs_of(type(drafter))[fmt].serving(drafter).items() if engine in ENGINES]
    return "\n\n".join(commands) or "No serving engine reads this format: `drafttrain eval --draft THIS_REPO` loads it."


def _files_text(exported: Exported, fmt: str) -> str:
    rows = ["- `config.json`, `model.safetensors`: the draft in the " + fmt + " layout (the `drafttrain` section "
            "of the config is ignored by engines and lets `drafttrain eval --draft` load the export)",
            "- `manifest.json`: size and sha256 of every file, and what the draft was built from",
            "- `eval/report.json`: the evaluation behind the table above, when there is one"]
    return "\n".join(rows + exported.files)
