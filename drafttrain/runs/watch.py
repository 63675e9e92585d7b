"""A run's checkpoints measured in the serving engine by a process of their own (``drafttrain watch RECIPE``): on
other GPUs or another node than the trainer's, while it trains or after it finished.

The watcher follows ``checkpoints/``: each complete checkpoint without an engine record (CHECKPOINT/engine.json) is
measured once, as the trainer measures it inline (serving/checkpoint_engine.py), and its figures are appended to the
run's metrics.jsonl and logged into the run's own wandb run (resumed by the id in ``wandb_run_id``). It keeps the
best checkpoint (best.json) when the run is kept by the engine's τ. It holds a lock of its own, so one watcher works
per run beside the trainer; a checkpoint the trainer prunes while it is measured is skipped, said so; it ends once
the checkpoint of the run's last step is measured (or after one pass, ``once``).

With ``agreement`` the watcher holds the whole target and drafttrain's evaluator decodes the same prompts with each
checkpoint, the two τ compared (also for checkpoints the trainer measured without it, under ZeRO-3); otherwise it
holds the target's head alone, at any target size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from drafttrain import DrafttrainError, targets
from drafttrain.config import Recipe
from drafttrain.runfolder import STATE_FILE, WATCH_LOCK_FILE, RunFolder, RunLock, complete_checkpoints
from drafttrain.runs.train import holds_whole_target
from drafttrain.serving.checkpoint_engine import EngineCheckpoints, check_engine, read_record
from drafttrain.targets.partial import load_head
from drafttrain.training.checkpoint import CheckpointManager, TrainerState
from drafttrain.training.run_log import EvalLog
from drafttrain.training.runtime import configured_zero_stage

log = logging.getLogger(__name__)

ENGINE_BEST = "engine_tau"


@dataclasses.dataclass
class WatchResult:
    measured: list[int] = dataclasses.field(default_factory=list)  # steps measured in the engine
    agreed: list[int] = dataclasses.field(default_factory=list)  # steps whose agreement was added
    pruned: list[int] = dataclasses.field(default_factory=list)  # steps pruned while they were measured


def check_watchable(recipe: Recipe) -> None:
    if recipe.draft is None or recipe.eval.engine == "none":
        raise DrafttrainError("the recipe names no engine to measure checkpoints in: set eval.engine: vllm (and "
                              "eval.engine_settings), in the recipe or as an override (eval.engine=vllm)")
    if recipe.eval.engine_settings.inline:
        raise DrafttrainError("eval.engine_settings.inline is true: `drafttrain train` measures this run's checkpoints "
                              "itself. For a watcher, train with eval.engine_settings.inline: false (or, for a run "
                              "that has finished, give eval.engine_settings.inline=false here)")
    check_engine(recipe)


def watch(recipe: Recipe, once: bool = False, poll_s: float = 30.0, agreement: bool = False) -> WatchResult:
    """Measure the run's checkpoints as they come (see the module docstring); returns what it measured."""
    check_watchable(recipe)
    run = RunFolder.of(recipe.output_dir)
    if not run.root.is_dir():
        raise DrafttrainError(f"{run.root} does not exist: start `drafttrain train` with this recipe first (or give "
                              "the recipe it runs with)")
    with RunLock(run.root, "drafttrain watch", WATCH_LOCK_FILE):
        target = targets.load_target(recipe.target) if agreement else load_head(recipe.target)
        measure = EngineCheckpoints(recipe, target, whole=agreement)
        records, result = EvalLog(recipe), WatchResult()
        best = CheckpointManager(run.checkpoints, recipe.training.keep_last, ENGINE_BEST) \
            if keeps_best_by_engine(recipe) else None
        try:
            while True:
                for step, checkpoint in pending(run, agreement):
                    _measure_one(measure, records, best, step, checkpoint, result)
                if once or (finished(run, recipe) and not pending(run, agreement)):
                    return result
                time.sleep(poll_s)
        finally:
            records.close()


def keeps_best_by_engine(recipe: Recipe) -> bool:
    """Whether the run keeps its best checkpoint by the engine's τ (runs/train.py: best_metric_of), which only the
    watcher measures when the engine is not inline."""
    if recipe.training.best_metric:
        return recipe.training.best_metric == ENGINE_BEST
    trainer_whole = holds_whole_target(recipe, configured_zero_stage(recipe.training) == 3)
    return not (recipe.eval.every_checkpoint and trainer_whole)


def pending(run: RunFolder, agreement: bool) -> list[tuple[int, Path]]:
    """Complete checkpoints the engine has not measured, and with ``agreement`` those measured without it."""
    return [(step, checkpoint) for step, checkpoint in complete_checkpoints(run.checkpoints)
            if _needs(read_record(checkpoint), agreement)]


def _needs(record: dict | None, agreement: bool) -> bool:
    if record is None:
        return True
    if not agreement or "engine_tau" not in record["metrics"]:
        return False
    return "agreement" not in record or "skipped" in record["agreement"]


def finished(run: RunFolder, recipe: Recipe) -> bool:
    """Whether the run's newest checkpoint is its last step's: every step trained, or the time budget spent (the
    trainer's own rule)."""
    done = complete_checkpoints(run.checkpoints)
    if not done:
        return False
    state = TrainerState.read(done[-1][1] / STATE_FILE)
    budget = recipe.training.time_budget_minutes
    return state.step >= state.total_steps or (budget is not None and state.train_seconds >= budget * 60)


def _measure_one(measure: EngineCheckpoints, records: EvalLog, best: CheckpointManager | None, step: int,
                 checkpoint: Path, result: WatchResult) -> None:
    """One checkpoint measured (or its agreement added) into the run's records; one the trainer pruned meanwhile is
    skipped, said so."""
    record = read_record(checkpoint) if checkpoint.is_dir() else None
    try:
        figures = measure.agree_later(checkpoint) if record is not None else measure(step, checkpoint)
    except (DrafttrainError, OSError) as err:
        if checkpoint.is_dir():
            raise
        log.warning("%s was pruned while it was measured (training.keep_last), going on (%s)", checkpoint.name,
                    str(err).splitlines()[0])
        result.pruned.append(step)
        return
    records.write_eval(step, figures)
    (result.agreed if record is not None else result.measured).append(step)
    if best is not None and ENGINE_BEST in figures.scalars and best.consider_best(checkpoint, step, figures.scalars):
        log.info("%s is the best checkpoint so far by the engine's τ (%.3f)", checkpoint.name,
                 figures.scalars[ENGINE_BEST])
