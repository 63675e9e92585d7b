"""``drafttrain quickstart``: prepare → train → evaluate the bundled SmolLM2 quick recipe, end to end on CPU.

The console shows one line and one progress bar per stage and a final table; everything the libraries log
(accelerate, DeepSpeed, wandb, transformers, per-step metrics) goes to ``quickstart.log`` in the run folder.
Re-running continues where it stopped: regeneration resumes (and reuses earlier answers), the tokenised data comes
from the cache, and training resumes from its last checkpoint (a finished run is not retrained).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path

from drafttrain import DrafttrainError
from drafttrain.config import load_recipe
from drafttrain.progress import PROGRESS_EVERY_S, PROGRESS_LOGGER, on_terminal
from drafttrain.runfolder import RunFolder
from drafttrain.targets import Target

DEFAULT_RECIPE = "recipes/smollm2_eagle3_quick.yaml"
LOG_FILE = "quickstart.log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe YAML (default: {DEFAULT_RECIPE})")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides")


def run(args: argparse.Namespace) -> int:
    if not Path(args.recipe).is_file():
        raise DrafttrainError(f"recipe {args.recipe} not found: run the quickstart from the repository root")
    recipe = load_recipe(args.recipe, args.overrides)
    run = RunFolder.of(recipe.output_dir)
    run.claim()  # before its log file goes there: a folder drafttrain did not make is refused, not written in
    started = time.perf_counter()
    with libraries_log_to(run.root / LOG_FILE):
        # imported once the libraries' logs go to the log file: some bind their handlers at import
        from drafttrain.runs.train import train
        from drafttrain.targets import load_target
        from drafttrain.training.prepare import prepare

        target = load_target(recipe.target)  # one load serves all three stages
        say(f"[1/3] prepare: {recipe.data.num_samples} conversations, answered by {recipe.target.model}")
        prepare(recipe, target=target, show_summary=False)
        say(f"[2/3] train: the {recipe.draft.kind} draft, checkpoints under {run.checkpoints}")
        result = train(recipe, resume=True, target=target)
        best = result.best_checkpoint or result.last_checkpoint
        say(f"[3/3] evaluate {best.name} on {recipe.eval.suite} against plain decoding of the same prompts")
        report = evaluate_checkpoint(recipe, target, best, run.eval)
    print_summary(report, best, run, (time.perf_counter() - started) / 60)
    return 0 if report.overall.get("greedy_match") in (None, 1.0) else 1


def say(text: str) -> None:
    print(text, file=sys.__stdout__, flush=True)


@contextlib.contextmanager
def libraries_log_to(path: Path):
    """Send every library's logging and printing to ``path``; the console keeps our stage lines (``say``), the
    progress bars (stderr) and warnings from drafttrain itself."""
    import warnings

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    consoles = [h for h in root.handlers if type(h) is logging.StreamHandler]
    console_filter = ConsoleLines(progress_every_s=None if on_terminal() else PROGRESS_EVERY_S)
    for h in consoles:
        h.addFilter(console_filter)
    root.addHandler(handler)
    level, root.level = root.level, logging.INFO  # the log file gets the INFO lines, whatever the console shows
    logging.captureWarnings(True)
    os.environ.setdefault("WANDB_SILENT", "true")
    with open(path, "a") as chatter, warnings.catch_warnings(), contextlib.redirect_stdout(chatter):
        warnings.simplefilter("default")
        _quiet_libraries(chatter)
        try:
            yield
        finally:
            root.removeHandler(handler)
            root.setLevel(level)
            for h in consoles:
                h.removeFilter(console_filter)
            logging.captureWarnings(False)


class ConsoleLines(logging.Filter):
    """What the console shows while the libraries log to the file: drafttrain's warnings, and where no progress
    bar can be drawn (``progress_every_s`` set: the output is a log file, CI, nohup) a progress record now and
    then, so a long stage is never silent."""

    def __init__(self, progress_every_s: float | None):
        super().__init__()
        self.every, self.last = progress_every_s, -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == PROGRESS_LOGGER and self.every is not None and record.created - self.last >= self.every:
            self.last = record.created
            return True
        return record.name.startswith("drafttrain") and record.levelno >= logging.WARNING


def _quiet_libraries(chatter) -> None:
    """Libraries that print through their own handlers or to stdout at import: import them writing to the log."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars
    with contextlib.redirect_stderr(chatter):
        with contextlib.suppress(ImportError):
            import deepspeed  # noqa: F401  (its logger binds to the stream it sees at import: the log file)
        import datasets

        datasets.disable_progress_bars()


# The head is always shown at this depth, beside the auto choice: a user who just trained it sees what it does even
# where this machine's costs make plain decoding the faster choice.
SHOWN_DEPTH = 3
AUTO_LABEL = "depth auto"


def evaluate_checkpoint(recipe, target: Target, checkpoint: Path, out_dir: Path):
    """The head at ``SHOWN_DEPTH`` against plain decoding, and, when the recipe asks for depth auto, the auto
    choice as a second side on the same prompts in the same run."""
    from drafttrain.drafts import load_drafter
    from drafttrain.evaluation.checkpoint_eval import evaluate_drafter
    from drafttrain.evaluation.report import write_report
    from drafttrain.evaluation.sides import Compared
    from drafttrain.evaluation.suites import load_suite

    questions = load_suite(recipe.eval.suite).select(num_prompts=recipe.eval.num_prompts, turns="1")
    drafter = load_drafter(checkpoint, target)
    auto = recipe.eval.depth == "auto"
    limit = type(drafter).max_draft_depth(drafter.config) or SHOWN_DEPTH
    shown = min(SHOWN_DEPTH, limit, recipe.eval.max_depth)  # no deeper than the auto side considers
    report = evaluate_drafter(recipe, target, drafter, questions, depth=shown if auto else None,
                              compare=[Compared(drafter, depth="auto", label=AUTO_LABEL)] if auto else ())
    write_report(report, out_dir)
    return report


def print_summary(report, checkpoint: Path, run: RunFolder, minutes: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from drafttrain.evaluation.report import fmt

    overall, config = report.overall, report.config
    table = Table(title=f"drafttrain quickstart: done in {minutes:.1f} min", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("draft", f"{checkpoint.parent.parent.name}/{checkpoint.parent.name}/{checkpoint.name}")
    table.add_row(f"the head at depth {config['depth']}: τ", f"{fmt(overall['tau'])} tokens per target forward")
    positions = overall["acceptance_per_position"]["conditional"]
    table.add_row("acceptance per position", "  ".join(
        f"d{i + 1} {'—' if a is None else f'{a:.0%}'}" for i, a in enumerate(positions)) or "—")
    interval = overall.get("speedup_ci95")
    spread = f", 95% interval {interval[0]:.2f}–{interval[1]:.2f}×" if interval else ""
    table.add_row("speedup over plain decoding",
                  f"{fmt(overall['speedup'], 2, '×')} ({fmt(overall['tokens_per_s'], 1)} vs "
                  f"{fmt(overall['baseline_tokens_per_s'], 1)} tokens/s, {config['suite']}, {overall['num_prompts']} "
                  f"prompts, same run{spread})")
    auto = auto_side(report)
    if auto is not None:
        table.add_row(AUTO_LABEL, auto_text(*auto))
    table.add_row("greedy output identical", "—" if overall["greedy_match"] is None else f"{overall['greedy_match']:.0%}")
    # a log file or CI gets rich's 80 columns; the table's cells read better unwrapped
    console = Console(file=sys.__stdout__, width=None if on_terminal() else 120)
    console.print(table)
    for line in plain_wins_lines(report, auto):
        console.print(line, soft_wrap=True, highlight=False)
    # paths on lines of their own, whole, to copy
    for what, path in (("report", run.eval / "report.md"), ("plot", run.eval / "acceptance.png"),
                       ("log", run.root / LOG_FILE)):
        console.print(f"{what}: {path}", soft_wrap=True, highlight=False)
    note = (config.get("machine_load") or {}).get("note")
    if note:
        console.print(f"NOTE: {note}. Rerun `drafttrain quickstart` with nothing else running: it continues where "
                      "it stopped and measures again.", soft_wrap=True, highlight=False)


def auto_side(report) -> tuple[dict, dict] | None:
    """(what the report's config says of the depth-auto side, its measured line), or None without one."""
    described = next((c for c in report.config.get("compare") or [] if c.get("label") == AUTO_LABEL), None)
    line = report.comparisons.get(AUTO_LABEL)
    return None if described is None or line is None else (described, line)


def auto_text(described: dict, line: dict) -> str:
    """The auto choice, its reason, and what it measured in this run."""
    from drafttrain.evaluation.report import fmt, runtime_text

    choice = described["depth_auto"]
    measured = f"measured {fmt(line['speed_vs_baseline'], 2, '×')} in this run"
    if choice["depth"] == 0:
        best = max((s, int(d)) for d, s in choice["predicted_speedup_by_depth"].items() if int(d) > 0)
        return (f"plain decoding: on this machine no depth pays (best predicted {best[0]:.2f}× at depth {best[1]}); "
                f"{measured}")
    threshold = f", stop below confidence {choice['min_confidence']:g}" if choice["min_confidence"] else ""
    text = f"depth {choice['depth']}{threshold}: predicted {choice['predicted_speedup']:.2f}× here; {measured}"
    check = described.get("runtime_check")
    return text + (f"; checked while decoding: {runtime_text(check)}" if check and check["switches"] else "")


def plain_wins_lines(report, auto: tuple[dict, dict] | None) -> list[str]:
    """When plain decoding is the faster choice on this machine: why (a cycle's measured cost against a plain step),
    and what the head's measured τ would give where a verification costs one plain step, marked as a projection."""
    depth, tau = report.config["depth"], report.overall["tau"]
    if auto is None or auto[0]["depth_auto"]["depth"] != 0 or tau is None:
        return []
    costs = auto[0]["depth_auto"]
    deepest = min(depth, len(costs["draft_ms"]) - 1)
    plain, verify, draft = costs["plain_step_ms"], costs["verify_ms"][deepest], costs["draft_ms"][deepest]
    cycle = verify + draft + costs["cycle_overhead_ms"]
    return [
        f"Why plain decoding wins here: a depth-{deepest} cycle costs {cycle:.0f} ms on this machine (verifying "
        f"{deepest + 1} tokens {verify:.0f} ms, drafting {draft:.0f} ms, the loop {costs['cycle_overhead_ms']:.0f} ms) "
        f"against a {plain:.0f} ms plain step, so it must yield {cycle / plain:.2f} tokens to pay; the head yields "
        f"τ {tau:.2f}.",
        f"Projection from the measured τ, not measured: where verifying {deepest + 1} tokens costs one plain step "
        f"(a GPU-served target), τ {tau:.2f} would give up to {tau:.2f}× ({tau / (1 + draft / plain):.2f}× with "
        f"drafting at this machine's {draft / plain:.2f} plain steps).",
    ]
