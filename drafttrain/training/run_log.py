"""Training metrics: ``<output_dir>/metrics.jsonl``, Weights & Biases and the console progress line.

Only numbers are logged (losses, accuracies, learning rate, throughput, eval metrics) plus, on wandb, tables of
numbers and the acceptance plot: never token ids, text or secrets. Everything here runs on the main process only;
the trainer reduces values across ranks first.

On wandb, training records go under ``train/`` against ``train/step`` and checkpoint evaluations under ``eval/``
against ``eval/step`` (``define_metric``), so acceptance charts are drawn over checkpoint steps and a resumed run
that logs a step again is not dropped by wandb's monotonic step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import resource
import statistics
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from drafttrain import DrafttrainError
from drafttrain.config import Recipe, WandbConfig
from drafttrain.drafts.base import add_positions, simulated_tau
from drafttrain.progress import PROGRESS_LOGGER, on_terminal
from drafttrain.runfolder import ACCELERATE_DIR, RunFolder, damaged, write_text_atomic
from drafttrain.userfiles import writing

log = logging.getLogger(__name__)
progress_log = logging.getLogger(PROGRESS_LOGGER)

_SECRET_KEY = re.compile(r"key|token|secret|password", re.IGNORECASE)


def resolve_wandb_mode(cfg: WandbConfig, environ: dict[str, str] | os._Environ = os.environ) -> str:
    """online / offline / disabled (the recipe's rule: ``WandbConfig.resolved_mode``)."""
    return cfg.resolved_mode(environ)


def _public_config(value: Any) -> Any:
    """The recipe as logged to wandb, without anything that looks like a credential."""
    if isinstance(value, dict):
        return {k: _public_config(v) for k, v in value.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(value, list):
        return [_public_config(v) for v in value]
    return value


def _finite_or_none(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


@dataclasses.dataclass
class CheckpointMetrics:
    """What a checkpoint evaluation measured. ``scalars`` are kept with the checkpoint and in metrics.jsonl (and
    choose the best checkpoint); ``tables`` (name -> (columns, rows of numbers or category names)) and ``images``
    (name -> PNG file) go to the dashboard only."""

    scalars: dict[str, float]
    tables: dict[str, tuple[list[str], list[list[Any]]]] = dataclasses.field(default_factory=dict)
    images: dict[str, Path] = dataclasses.field(default_factory=dict)

    def merge(self, other: "CheckpointMetrics | dict[str, float] | None") -> None:
        if isinstance(other, CheckpointMetrics):
            self.scalars.update(other.scalars)
            self.tables.update(other.tables)
            self.images.update(other.images)
        elif other:
            self.scalars.update(other)


class WindowMeter:
    """Sums over the micro-batches since the last log line, on one rank."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.steps = 0
        self.metric_sums: dict[str, float] = defaultdict(float)
        self.metric_counts: dict[str, int] = defaultdict(int)
        self.correct: list[float] = []  # per draft position, summed over micro-batches
        self.counted: list[float] = []
        self.tokens = 0
        self.trainable_tokens = 0
        self.started = time.perf_counter()

    def add_micro_batch(self, metrics: dict[str, float], correct: list[float], counted: list[float], tokens: int,
                        trainable: int):
        for key, value in metrics.items():
            self.metric_sums[key] += float(value)
            self.metric_counts[key] += 1
        self.correct, self.counted = add_positions(self.correct, correct), add_positions(self.counted, counted)
        self.tokens += tokens
        self.trainable_tokens += trainable

    def add_step(self, loss: float) -> None:
        self.loss_sum += loss
        self.steps += 1

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training (checkpoints, evaluation) out of the throughput."""
        self.started += seconds

    def local_summary(self) -> dict[str, Any]:
        """Plain sums, to be combined across ranks (gather_object) before ``summarise``."""
        return {
            "loss_sum": self.loss_sum,
            "steps": self.steps,
            "metric_sums": dict(self.metric_sums),
            "metric_counts": dict(self.metric_counts),
            "correct": list(self.correct),
            "counted": list(self.counted),
            "tokens": self.tokens,
            "trainable_tokens": self.trainable_tokens,
            "seconds": time.perf_counter() - self.started,
            "peak_memory": peak_memory_bytes(),
        }


def summarise(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Combine per-rank window sums: loss is the mean over steps (already rank-averaged), metrics the mean
    over all micro-batches of all ranks, throughput the sum over ranks divided by wall time."""
    first = parts[0]
    out: dict[str, float] = {"loss": first["loss_sum"] / max(1, first["steps"])}
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for part in parts:
        for key, value in part["metric_sums"].items():
            sums[key] += value
            counts[key] += part["metric_counts"][key]
    out.update({key: sums[key] / counts[key] for key in sorted(sums)})
    correct, counted = [], []
    for part in parts:
        correct, counted = add_positions(correct, part["correct"]), add_positions(counted, part["counted"])
    if counted:
        # per draft position, pooled over every token of every rank (not a mean of per-batch means)
        accuracies = [c / n if n else 0.0 for c, n in zip(correct, counted)]
        out.update({f"acc_{i}": a for i, a in enumerate(accuracies)})
        out["sim_tau"] = simulated_tau(accuracies)
    seconds = max(p["seconds"] for p in parts) or 1e-9
    out["tokens_per_s"] = sum(p["tokens"] for p in parts) / seconds
    out["trainable_tokens_per_s"] = sum(p["trainable_tokens"] for p in parts) / seconds
    out["peak_memory_mib"] = max(p.get("peak_memory", 0) for p in parts) / 2**20  # the fullest process's
    return out


def peak_memory_bytes() -> int:
    """This process's peak so far: the CUDA allocator's reserved memory on a GPU, resident memory on CPU (what
    ``drafttrain plan`` predicts)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved()

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLog:
    """Writes one JSON object per log step to metrics.jsonl, mirrors it to wandb and the console."""

    def __init__(self, recipe: Recipe, total_steps: int, start_step: int, resumed: bool):
        self.run = RunFolder.of(recipe.output_dir)
        self.run.root.mkdir(parents=True, exist_ok=True)
        self.path = self.run.metrics
        with self._writing():
            self._prepare_file(start_step, resumed)
            self._file = open(self.path, "a")
        self._wandb = self._start_wandb(recipe, resumed)
        self._bar = self._start_bar(total_steps, start_step)
        self._total, self._start_step, self._started = total_steps, start_step, time.perf_counter()
        budget = recipe.training.time_budget_minutes
        self._budget_s = budget * 60 if budget is not None else None
        self._throughput = ThroughputWatch()

    def _writing(self):
        """A full disk, a file-size limit or a read-only run folder while the log is written: one line."""
        return writing(self.path, "the training log", after="; the checkpoints written so far are whole: make room "
                                                            "and continue with --resume")

    def _prepare_file(self, start_step: int, resumed: bool) -> None:
        """A fresh run starts an empty file; a resumed one drops records from steps it is about to redo."""
        if not resumed or not self.path.is_file():
            self.path.write_text("")
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and _step_of(line) <= start_step]
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def _start_wandb(self, recipe: Recipe, resumed: bool):
        mode = resolve_wandb_mode(recipe.wandb)
        if mode == "disabled":
            return None
        id_file = self.run.wandb_id
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else uuid.uuid4().hex[:12]
        with writing(id_file, "the wandb run id"):
            id_file.write_text(run_id + "\n")
        return wandb_run(recipe, self.run, run_id, mode, config=_public_config(recipe.model_dump(mode="json")))

    def _start_bar(self, total_steps: int, start_step: int):
        # On a non-terminal (log files, CI) the bar is off and each record becomes a log line instead.
        return tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                    disable=not on_terminal())

    def write(self, record: dict[str, Any]) -> None:
        """One training record (``step`` and numbers)."""
        record = self._append(record)
        self._throughput.check(record)
        if self._wandb is not None:
            self._wandb.log({"train/step": record["step"],
                             **{f"train/{k}": v for k, v in record.items() if k != "step"}})

    def write_eval(self, step: int, measured: CheckpointMetrics) -> None:
        """One checkpoint's evaluation: its numbers as ``eval/...``; on wandb also its tables and images."""
        self._append(eval_record(step, measured))
        if self._wandb is not None:
            self._wandb.log(wandb_eval_entry(step, measured))

    def log_checkpoint(self, checkpoint: Path, aliases: list[str]) -> None:
        """The checkpoint's draft files (not its optimizer state) as a wandb model artifact."""
        if self._wandb is None:
            return
        import wandb  # imported when a run logs to it (its import takes seconds)

        artifact = wandb.Artifact(f"{self.run.root.name}-draft", type="model",
                                  metadata={"checkpoint": checkpoint.name})
        for path in sorted(checkpoint.rglob("*")):
            relative = path.relative_to(checkpoint)
            if path.is_file() and relative.parts[0] != ACCELERATE_DIR:
                artifact.add_file(str(path), name=relative.as_posix())
        self._wandb.log_artifact(artifact, aliases=aliases)

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        record = {k: _finite_or_none(v) for k, v in record.items()}
        with self._writing():
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._bar.disable and "loss" in record:  # no bar on a non-terminal: a progress record line instead
            progress_log.info("%s", self._progress_line(record))
        return record

    def _progress_line(self, record: dict[str, Any]) -> str:
        """``step=S/T ... eta=...``: the record, with how far the run is and the time left at the rate so far."""
        step, done = record["step"], record["step"] - self._start_step
        left = (time.perf_counter() - self._started) / done * (self._total - step) if done > 0 else None
        if left is not None and self._budget_s is not None and "train_s" in record:  # the budget ends it sooner
            left = min(left, max(0.0, self._budget_s - record["train_s"]))
        fields = {k: v for k, v in record.items() if k != "step"}
        eta = "" if left is None else f" eta={left / 60:.1f}min"
        return f"step={step}/{self._total} " + " ".join(f"{k}={_short(v)}" for k, v in fields.items()) + eta

    def advance(self, step: int, postfix: dict[str, float] | None = None) -> None:
        self._bar.update(step - self._bar.n)
        if postfix:
            self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_run(recipe: Recipe, run: RunFolder, run_id: str, mode: str, config: dict[str, Any] | None = None):
    """The run's wandb run ``run_id`` (started, or resumed: another process may log into it after the trainer),
    with training records drawn against ``train/step`` and checkpoint evaluations against ``eval/step``."""
    import wandb  # imported when a run logs to it (its import takes seconds)

    started = wandb.init(
        project=recipe.wandb.project,
        name=run.root.name,
        id=run_id,
        resume="allow",
        dir=str(run.root),
        mode=mode,
        config=config,
        # console capture could record anything printed (e.g. data samples); code is not needed either.
        settings=wandb.Settings(console="off", save_code=False),
    )
    for section in ("train", "eval"):
        started.define_metric(f"{section}/step")
        started.define_metric(f"{section}/*", step_metric=f"{section}/step")
    started.define_metric("eval/tau", step_metric="eval/step", summary="max")
    started.define_metric("eval/engine_tau", step_metric="eval/step", summary="max")
    return started


def eval_record(step: int, measured: CheckpointMetrics) -> dict[str, Any]:
    """A checkpoint's evaluation as metrics.jsonl holds it: ``{"step": N, "eval/<name>": value, ...}``."""
    return {"step": step, **{f"eval/{k}": float(v) for k, v in measured.scalars.items() if v is not None}}


def wandb_eval_entry(step: int, measured: CheckpointMetrics) -> dict[str, Any]:
    """A checkpoint's evaluation as a wandb entry: its numbers as ``eval/...``, its tables and images."""
    import wandb  # imported when a run logs to it (its import takes seconds)

    entry: dict[str, Any] = {"eval/step": step, **{f"eval/{k}": _finite_or_none(float(v))
                                                   for k, v in measured.scalars.items() if v is not None}}
    for name, (columns, rows) in measured.tables.items():
        entry[f"eval/{name}"] = wandb.Table(columns=list(columns), data=[list(r) for r in rows])
    for name, path in measured.images.items():
        if Path(path).is_file():
            entry[f"eval/{name}"] = wandb.Image(str(path))
    return entry


class EvalLog:
    """Checkpoint evaluations written into a run's records from another process than its trainer's (``drafttrain
    watch``): appended to its metrics.jsonl, and logged into its own wandb run (the id in the run folder's
    ``wandb_run_id``, resumed; started at the first evaluation, when the trainer has written that id)."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.run = recipe, RunFolder.of(recipe.output_dir)
        self.mode = resolve_wandb_mode(recipe.wandb)
        self._wandb, self._warned = None, False

    def write_eval(self, step: int, measured: CheckpointMetrics) -> None:
        with writing(self.run.metrics, "the run's training log"), self.run.metrics.open("a") as out:
            out.write(json.dumps({k: _finite_or_none(v) for k, v in eval_record(step, measured).items()}) + "\n")
        run = self._wandb_run()
        if run is not None:
            run.log(wandb_eval_entry(step, measured))

    def _wandb_run(self):
        if self._wandb is None and self.mode != "disabled":
            if not self.run.wandb_id.is_file():
                if not self._warned:
                    log.warning("%s is missing (the trainer has not started wandb): evaluations go to %s alone",
                                self.run.wandb_id, self.run.metrics)
                self._warned = True
                return None
            self._wandb = wandb_run(self.recipe, self.run, self.run.wandb_id.read_text().strip(), self.mode)
        return self._wandb

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


class ThroughputWatch:
    """Warns when training's tokens/s falls far below the run's own earlier rate (another job on the machine, a
    throttled GPU), once per slow spell: a run that quietly trains at a third of its speed misses its budget."""

    SLOW_SHARE = 0.5  # below this share of the earlier median rate
    EARLIER = 3  # records needed before a rate is judged

    def __init__(self):
        self.rates: list[float] = []
        self.slow = False

    def check(self, record: dict[str, Any]) -> None:
        rate = record.get("tokens_per_s")
        if not isinstance(rate, (int, float)) or not rate > 0:
            return
        usual = statistics.median(self.rates) if len(self.rates) >= self.EARLIER else None
        self.rates.append(rate)
        if usual is None:
            return
        now_slow = rate < self.SLOW_SHARE * usual
        if now_slow and not self.slow:
            log.warning("training throughput fell to %.0f tokens/s at step %s, %.0f%% of this run's earlier %.0f "
                        "tokens/s: is another job sharing the machine? (checkpoint evaluations are not counted)",
                        rate, record.get("step"), 100 * rate / usual, usual)
        elif self.slow and not now_slow:
            log.info("training throughput is back to %.0f tokens/s at step %s", rate, record.get("step"))
        self.slow = now_slow


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def read_metrics(run: RunFolder) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, checkpoint evaluation records) of a run's metrics.jsonl, in step order."""
    if not run.metrics.is_file():
        raise DrafttrainError(f"{run.metrics} is missing: the run has not trained yet (`drafttrain train`)")
    train, evals = [], []
    lines = run.metrics.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # what a crash mid-append leaves: the records before it are whole
                log.warning("%s: skipping its half-written last line %d", run.metrics, number)
                break
            raise damaged(run.metrics, f"line {number} is not JSON") from None
        (evals if any(k.startswith("eval/") for k in record) else train).append(record)
    return train, evals
