"""The training loop: a drafter learns from the target's outputs, with accelerate (DDP / DeepSpeed ZeRO).

What accelerate wraps is :class:`TrainStep`: the target outputs the kind needs (from the run's target source: the
target's forward, the offline cache, or capture engines streaming them; drafttrain.sources), then the kind's loss. The target's module is registered in it only when the kind trains part of
the target (LoRA); a frozen target is just moved to the device, since wrapping it would make DDP/ZeRO track and
shard weights that never change. The trainer never names a draft kind: it asks the drafter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed
from torch import nn

from drafttrain import DrafttrainError
from drafttrain.config import Recipe
from drafttrain.data.tokenize import split_fingerprint
from drafttrain.data.traffic import redacted
from drafttrain.runfolder import (
    ACCELERATE_DIR,
    EVAL_FILE,
    STATE_FILE,
    RunFolder,
    damaged,
    step_dir_name,
    write_manifest,
)
from drafttrain.sources.base import TargetSource, mean_stats
from drafttrain.sources.choose import HeldOut
from drafttrain.sources.hf import HFForward
from drafttrain.targets import Target
from drafttrain.training.checkpoint import (
    DAMAGED_SUFFIX,
    DIVERGED_SUFFIX,
    CheckpointManager,
    TrainerState,
    recipe_changes,
)
from drafttrain.training.held_out import held_out_accuracy
from drafttrain.training.loader import (
    ROW_INDEX,
    BatchLayout,
    ResumableBatchSampler,
    epoch_loader,
    row_ids,
    to_device,
    trained_tokens,
)
from drafttrain.training.run_log import CheckpointMetrics, MetricsLog, WindowMeter, summarise
from drafttrain.training.runtime import build_accelerator, gathered, local_part, shard_frozen, zero_stage_of
from drafttrain.training.schedule import build_optimizer, build_scheduler, select_trainable, total_steps
from drafttrain.userfiles import writing

log = logging.getLogger(__name__)

# Weights this many times the largest at the start of training have exploded, however finite they still are.
DIVERGED_FACTOR = 1e3

# fn(step, checkpoint_dir) -> metrics ({"tau": 3.1}, or CheckpointMetrics with dashboard tables and images); runs
# on the main process after each checkpoint.
CheckpointCallback = Callable[[int, Path], "CheckpointMetrics | dict[str, float] | None"]


@dataclasses.dataclass
class TrainResult:
    steps: int  # optimizer steps done in total (including those before a resume)
    final_loss: float | None
    losses: dict[int, float]  # step -> loss (mean over ranks), for the steps this call ran
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    best: dict[str, Any] | None  # {"checkpoint", "step", "metric", "value"}
    trainable_parameters: int
    resumed_from: Path | None
    metrics_path: Path


class TrainStep(nn.Module):
    """What accelerate wraps, so DDP and ZeRO hooks see one forward: the target outputs, then the kind's loss."""
    def __init__(self, drafter: nn.Module, target: Target, source: TargetSource, mask_shift: int = 0):
        super().__init__()
        self.drafter, self.mask_shift = drafter, mask_shift
        self.__dict__["source"] = source  # not a submodule
        # The modules that own the target parameters the kind trains (LoRA adapters) are registered here, so the
        # engine tracks, shards and saves them; the frozen rest of the target is not (checkpoints hold no copy).
        self.trained_target = nn.ModuleList(owners(target.model, drafter.trainable_target_parameters()))

    def forward(self, batch: dict[str, torch.Tensor], source: TargetSource | None = None):
        """The kind's step on ``batch``; ``source``: held-out rows' outputs, measured as they are (no own inputs)."""
        own = self.drafter.own_step_inputs(batch) if source is None else None  # asked first: the target then runs
        batch, outputs = own if own is not None else (batch, (source or self.source).outputs(batch))  # once
        if self.mask_shift:  # training.loss_mask_shift: the mask of the token fed in, kept inside each row
            mask = batch["loss_mask"]
            later = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1) * batch["attention_mask"]
            batch = {**batch, "loss_mask": later}
        return self.drafter.training_step(batch, outputs)


def owners(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The modules that own the named parameters, each once, in order."""
    found: dict[int, nn.Module] = {}
    for name in names:
        module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        found.setdefault(id(module), module)
    return list(found.values())


def online_outputs(target: Target, drafter) -> TargetSource:
    """The target runs inside every step. Gradients flow only where the kind trains the target."""
    return HFForward(target, drafter.needs())


def check_zero3(kind: str, trains_target: bool) -> None:
    """What ZeRO-3 covers today: a frozen target, partitioned, and a draft that trains only its own weights."""
    if trains_target:
        raise DrafttrainError(
            f"a {kind} draft that trains its target (LoRA) cannot run under ZeRO-3 yet: the target is "
            "partitioned in a frozen engine of its own; use ZeRO-2 (recipes/deepspeed/zero2.json)")


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        target: Target,
        drafter: nn.Module,
        train_dataset,
        source: TargetSource | None = None,
        callbacks: list[CheckpointCallback] | None = None,
        best_metric: str | None = None,
        accelerator=None,
        data_fingerprint: str | None = None,  # the train split's, when the caller has hashed it already
        held_out: HeldOut | None = None,  # the validation rows every checkpoint's held-out accuracy is measured on
    ):
        self.recipe, self.training = recipe, recipe.training
        self._data_fingerprint = data_fingerprint
        self._given_accelerator = accelerator  # made before the target loaded (ZeRO-3 partitions it at load)
        self.target, self.drafter, self.dataset = target, drafter, train_dataset
        self.source = source or online_outputs(target, drafter)  # where the target's outputs come from
        self.held_out = held_out
        self.on_checkpoint: list[CheckpointCallback] = list(callbacks or [])
        self.run = RunFolder.of(recipe.output_dir)
        self.checkpoints = CheckpointManager(
            self.run.checkpoints, self.training.keep_last, best_metric or self.training.best_metric
        )

    # -- setup ---------------------------------------------------------------------------------------------
    def train(self, resume: bool = False) -> TrainResult:
        self.accelerator = acc = self._given_accelerator or build_accelerator(self.training)
        self.zero3 = zero_stage_of(acc) == 3
        self.built_from = self._built_from()
        resume_from = self._start_folder(resume)
        set_seed(self.recipe.seed, device_specific=True)
        if self.zero3:
            check_zero3(self.drafter.kind, bool(self.drafter.trainable_target_parameters()))
            self.target_engine = shard_frozen(self.target.model, acc)  # partitioned over the processes
        else:
            self.target.model.to(acc.device)
        draft_params, target_params = select_trainable(self.target.model, self.drafter)
        optimizer = build_optimizer(draft_params, target_params, self.training, *self.drafter.target_learning())
        trainable = sum(p.numel() for p in draft_params + target_params)
        self.layout = BatchLayout(len(self.dataset), self.training.batch_size, acc.num_processes,
                                  self.training.gradient_accumulation)
        self.layout.check()
        steps = total_steps(self.training, self.layout)
        self.state = state = TrainerState(0, 0, 0, self.recipe.seed, len(self.dataset), self.training.batch_size,
                                          acc.num_processes, self.training.gradient_accumulation, steps)
        # the schedule reads the training clock of whatever state is current (a resumed run's, once restored)
        scheduler = build_scheduler(optimizer, self.training, steps, clock=lambda: self.state.train_seconds)
        self.recipe_hyperparameters = list(scheduler.base_lrs), [g["weight_decay"] for g in optimizer.param_groups]
        step_module = TrainStep(self.drafter, self.target, self.source, self.training.loss_mask_shift)
        self.module, self.optimizer, self.scheduler = acc.prepare(step_module, optimizer, scheduler)
        if resume_from is not None:
            self.state = state = self._restore(resume_from, state)
        self.start_scale = self._weight_scale()  # what "exploded" is measured against (DIVERGED_FACTOR)
        acc.print(
            f"trainable parameters: {trainable:,}; target parameters: "
            f"{sum(getattr(p, 'ds_numel', p.numel()) for p in self.target.model.parameters() if not p.requires_grad):,}"
            f" frozen{' (ZeRO-3: partitioned over the processes)' if self.zero3 else ''}; "
            f"{steps} steps of {self.layout.global_batch * self.layout.grad_accum} rows "
            f"({self.layout.steps_per_epoch} per epoch, {acc.num_processes} process(es))"
        )
        self.metrics = MetricsLog(self.recipe, steps, state.step, resumed=resume_from is not None) \
            if acc.is_main_process else None
        acc.wait_for_everyone()  # (wandb starts on the main process only) so throughput windows start together
        try:
            losses = self._loop(state)
            self._log_best_checkpoint()
        finally:
            if self.metrics is not None:
                self.metrics.close()
        return self._result(state, losses, trainable, resume_from)

    def _built_from(self) -> dict[str, Any]:
        """What this run's checkpoints are built from: the data, the target, its tokenizer, and the recipe."""
        return {"data": self._data_fingerprint or split_fingerprint(self.dataset), "target": self.target.fingerprint,
                "tokenizer": self.target.tokenizer_fingerprint,
                "recipe": redacted(self.recipe.model_dump(mode="json"))}  # a pasted key stays out of manifests

    def _start_folder(self, resume: bool) -> Path | None:
        """Clean up after a crashed run; pick the checkpoint to resume from (the newest that verifies), or refuse
        to overwrite a run."""
        acc = self.accelerator
        if acc.is_main_process:
            self.checkpoints.remove_orphans()
        acc.wait_for_everyone()
        latest = self.checkpoints.latest()
        if latest is not None and not resume:
            raise DrafttrainError(
                f"{self.run.root} already holds checkpoints (newest: {latest.name}): pass --resume to continue "
                "that run, or use another output_dir"
            )
        if not resume:
            return None
        path, self.resumed_built_from, skipped = self.checkpoints.resume_point(self.built_from)
        for damaged_path, line in skipped:
            acc.print(f"--resume: {line}; set aside as {damaged_path.name}{DAMAGED_SUFFIX}")
        acc.wait_for_everyone()  # every process has verified before the main one moves anything
        if acc.is_main_process:
            for damaged_path, _ in skipped:
                self.checkpoints.set_aside(damaged_path, DAMAGED_SUFFIX)
        acc.wait_for_everyone()
        if path is None:
            acc.print(f"--resume: no checkpoint under {self.checkpoints.root}, starting from step 0")
        return path

    def _restore(self, path: Path, fresh: TrainerState) -> TrainerState:
        saved = TrainerState.read(path / STATE_FILE)
        deepspeed = self.accelerator.state.deepspeed_plugin is not None
        problems = saved.resume_conflicts(fresh, deepspeed=deepspeed)
        refused, applied = recipe_changes(self.resumed_built_from["recipe"], self.built_from["recipe"])
        if problems or refused:
            raise DrafttrainError(f"cannot resume from {path}: " + "; ".join(problems + refused))
        try:
            self.accelerator.load_state(str(path / ACCELERATE_DIR))
        except Exception as err:  # noqa: BLE001 - torch / DeepSpeed raise many types for a state that does not fit
            raise damaged(path / ACCELERATE_DIR, f"cannot be loaded ({type(err).__name__}: {err})") from None
        self._apply_recipe_hyperparameters()
        if applied:
            self.accelerator.print("--resume: applying the recipe's new " + ", ".join(applied)
                                   + f"; the learning-rate schedule continues from step {saved.step} with them")
        saved.total_steps = fresh.total_steps
        self.accelerator.print(f"resumed from {path} at step {saved.step} (epoch {saved.epoch})")
        return saved

    def _apply_recipe_hyperparameters(self) -> None:
        """load_state restores the old run's learning rates and weight decay into the optimizer and schedule;
        put the recipe's back, with the schedule (possibly a new length or warm-up) at the restored step."""
        base_lrs, decays = self.recipe_hyperparameters
        schedule = self.scheduler.scheduler  # the LambdaLR inside accelerate's wrapper
        schedule.base_lrs = list(base_lrs)
        for group, base, decay, factor in zip(self.optimizer.param_groups, base_lrs, decays, schedule.lr_lambdas):
            group.update(initial_lr=base, lr=base * factor(schedule.last_epoch), weight_decay=decay)
        schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # -- loop ----------------------------------------------------------------------------------------------
    def _loop(self, state: TrainerState) -> dict[int, float]:
        losses: dict[int, float] = {}
        self.meter = WindowMeter()
        self.started = time.perf_counter()
        self.grad_norm: float | None = None
        while state.step < state.total_steps and not self._time_is_up(state):
            epoch = state.epoch
            rank, lengths = self.accelerator.process_index, self._row_lengths()
            batches = iter(epoch_loader(self.dataset, self.layout, state.data_seed, epoch, rank, state.batch_in_epoch,
                                        self.training.num_workers, _pad_id(self.target), lengths))
            # the rows this process will ask for, in order: a source that computes them elsewhere has them ready
            order = ResumableBatchSampler(self.layout, state.data_seed, epoch, rank, state.batch_in_epoch, lengths)
            self.source.ask(row for micro_batch in order for row in micro_batch)
            while state.epoch == epoch and state.step < state.total_steps and not self._time_is_up(state):
                group = [next(batches) for _ in range(self.layout.grad_accum)]
                loss = self._optimizer_step(group, state)
                self._advance(state)
                losses[state.step] = loss
                self.meter.add_step(loss)
                self._log_if_due(state)
                last = state.step == state.total_steps or self._time_is_up(state)
                if state.step % self.training.save_every == 0 or last:
                    saving = time.perf_counter()
                    self._checkpoint(state)
                    self.meter.exclude(time.perf_counter() - saving)  # throughput counts training time only
        return losses

    def _row_lengths(self) -> list[int] | None:
        """The rows' token counts when micro-batches group rows of similar length (training.group_by_length)."""
        if not self.training.group_by_length or self.training.batch_size == 1:
            return None  # one row a micro-batch: no padding to save, so the plain random order
        if "num_tokens" in self.dataset.column_names:
            return list(self.dataset["num_tokens"])
        return [len(ids) for ids in self.dataset["input_ids"]]

    def _time_is_up(self, state: TrainerState) -> bool:
        budget = self.training.time_budget_minutes
        return budget is not None and state.train_seconds >= budget * 60

    def _advance(self, state: TrainerState) -> None:
        state.step += 1
        state.batch_in_epoch += self.layout.grad_accum
        if state.batch_in_epoch >= self.layout.micro_batches_per_epoch:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0

    def _optimizer_step(self, group: list[dict[str, torch.Tensor]], state: TrainerState) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns their mean loss (mean over ranks too)."""
        acc = self.accelerator
        total, started = 0.0, time.perf_counter()
        weights = self._loss_weights(group)
        for i, batch in enumerate(group):
            rows = batch[ROW_INDEX].tolist()
            batch = to_device(batch, acc.device)
            with acc.accumulate(self.module):
                out = self.module(batch)
                self._check_finite(out.loss, state, state.batch_in_epoch + i, rows)
                acc.backward(out.loss * weights[i])
                if acc.sync_gradients:
                    self._apply_gradients(state, state.batch_in_epoch + i, rows)
            total += float(out.loss.detach())
            self.meter.add_micro_batch(
                out.metrics, out.correct, out.counted, int(batch["attention_mask"].sum()), trained_tokens(batch)
            )
        loss, seconds = total / len(group), time.perf_counter() - started
        if acc.num_processes > 1:  # one value on every rank: the loss logged, and the clock the schedule reads
            loss, seconds = acc.reduce(torch.tensor([loss, seconds], device=acc.device), reduction="mean").tolist()
        state.train_seconds += seconds
        return loss

    def _loss_weights(self, group: list[dict[str, torch.Tensor]]) -> list[float]:
        """Each micro-batch's loss multiplier (accelerate then divides by the accumulation). training.loss_reduction
        "token": n_i · G · W / N, n_i the micro-batch's trained tokens, N those of the whole step on all W ranks, so
        that the step's gradient is the token mean over all of them (DDP and DeepSpeed average over ranks). The
        counts are the loader's rows', also where the kind trains other rows in their place (on-policy answers), as
        TRL counts its dataset's labels."""
        if self.training.loss_reduction == "micro_batch":
            return [1.0] * len(group)
        acc = self.accelerator
        counts = torch.tensor([float(trained_tokens(batch)) for batch in group])
        total = counts.sum()
        if acc.num_processes > 1:
            total = acc.reduce(total.to(acc.device), reduction="sum").cpu()
        if float(total) == 0:  # nothing trains anywhere in this step: every loss is zero, keep them as they are
            return [1.0] * len(group)
        return (counts * len(group) * acc.num_processes / total).tolist()

    def _apply_gradients(self, state: TrainerState, micro: int, rows: list[int]) -> None:
        """Clip, step, schedule. (Under DeepSpeed the engine already stepped inside backward; these are no-ops
        there and clip_grad_norm_ just reports its norm.)"""
        norm = self.accelerator.clip_grad_norm_(self.module.parameters(), self.training.max_grad_norm)
        self.grad_norm = _as_float(norm)
        # fp16 loss scaling expects occasional inf gradients (the scaler skips that step); otherwise they are fatal.
        if self.grad_norm is not None and not math.isfinite(self.grad_norm) and self.training.mixed_precision != "fp16":
            self._fail(f"non-finite gradient norm ({self.grad_norm})", state, micro, rows)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _check_finite(self, loss: torch.Tensor, state: TrainerState, micro: int, rows: list[int]) -> None:
        """Stop before a NaN/inf reaches the weights. Collective under several processes, so every rank stops
        together instead of the others hanging in the next all-reduce."""
        bad_here = not bool(torch.isfinite(loss.detach()).all())
        bad_anywhere = self._on_any_process(bad_here)
        if bad_here:
            self._fail(f"non-finite loss ({float(loss.detach())})", state, micro, rows)
        if bad_anywhere:
            self._fail("non-finite loss on another process", state, micro, rows)

    def _on_any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (collective: every process asks together)."""
        if self.accelerator.num_processes == 1:
            return flag
        count = self.accelerator.reduce(torch.tensor(float(flag), device=self.accelerator.device), reduction="sum")
        return float(count) > 0

    def _weight_scale(self) -> float:
        """The largest absolute trainable weight (this process's part of each)."""
        return max((float(local_part(p).detach().abs().max()) for p in self.module.parameters()
                    if p.requires_grad and local_part(p).numel()), default=0.0)

    def _fail(self, what: str, state: TrainerState, micro: int, rows: list[int]) -> None:
        """Stop on a non-finite loss or gradient at step ``state.step + 1``. When the weights after ``state.step``
        exploded (finite, but DIVERGED_FACTOR times the largest weight at the start: a learning rate far too high),
        they produced it, so their checkpoint is no good either: it is set aside, and the one before it is named.
        (A non-finite loss from a bad row leaves normal weights, and their checkpoint good.)"""
        latest, scale = self.checkpoints.latest(), self._weight_scale()
        if latest is not None and latest.name == step_dir_name(state.step) and scale > DIVERGED_FACTOR * max(
                self.start_scale, 1e-6):
            if self.accelerator.is_main_process:
                aside = self.checkpoints.set_aside(latest, DIVERGED_SUFFIX)
                log.warning("%s holds exploded weights (largest |w| %.3g, %.3g at the start) that gave %s: set aside "
                            "as %s", latest.name, scale, self.start_scale, what, aside.name)
            latest = self.checkpoints.latest(before=state.step)
        kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"
        raise DrafttrainError(
            f"{what} at step {state.step + 1}, epoch {state.epoch}, batch {micro} of the epoch "
            f"(process {self.accelerator.process_index}; rows: {', '.join(row_ids(self.dataset, rows))}); "
            f"training stopped, {kept}"
        )

    # -- logging and checkpoints -----------------------------------------------------------------------------
    def _log_if_due(self, state: TrainerState) -> None:
        if state.step % self.training.log_every and state.step != state.total_steps:
            if self.metrics is not None:
                self.metrics.advance(state.step)
            return
        acc = self.accelerator
        part = (self.meter.local_summary(), self.source.stats())
        parts = gather_object([part]) if acc.num_processes > 1 else [part]
        self.meter.reset()
        lagging = self.source.lagging()
        if lagging is not None:
            log.warning("rank %d: %s", acc.process_index, lagging)
        if self.metrics is None:
            return
        summary = {**summarise([meter for meter, _ in parts]), **mean_stats([stats for _, stats in parts])}
        epoch = state.epoch + state.batch_in_epoch / self.layout.micro_batches_per_epoch
        record = {"step": state.step, "epoch": round(epoch, 4), "lr": self.scheduler.get_last_lr()[0],
                  "grad_norm": self.grad_norm, **summary,
                  "elapsed_s": round(time.perf_counter() - self.started, 2), "train_s": round(state.train_seconds, 2)}
        self.metrics.write(record)
        self.metrics.advance(state.step, {"loss": summary["loss"], "lr": record["lr"],
                                          "tok/s": summary["tokens_per_s"]})

    def _checkpoint(self, state: TrainerState) -> None:
        """Check, write, commit, evaluate, prune. Weights that are not finite are never saved. Callbacks run on the
        main process only, after the commit, so a failing evaluation never costs the checkpoint. A full disk, a
        file-size limit or a read-only folder is one line naming the checkpoint and the last one that is whole."""
        acc = self.accelerator
        self._check_weights_finite(state)
        tmp = self.checkpoints.tmp_dir(state.step)
        latest = self.checkpoints.latest()
        intact = (f"; the last complete checkpoint, {latest}, is intact: make room and continue with --resume"
                  if latest else "; no checkpoint was complete yet")
        with writing(tmp, "the checkpoint", after=intact):  # a full disk: one line, not torch's "unexpected pos"
            if acc.is_main_process:
                self.checkpoints.begin(state.step)
            acc.wait_for_everyone()
            acc.save_state(str(tmp / ACCELERATE_DIR))  # every rank: RNG states, and ZeRO shards under DeepSpeed
            acc.wait_for_everyone()
            with gathered(self.module.parameters(), self.zero3):  # ZeRO-3: the whole draft, whatever the world size
                if acc.is_main_process:
                    acc.unwrap_model(self.module).drafter.save_pretrained(tmp)
                    (tmp / STATE_FILE).write_text(state.to_json())
                    write_manifest(tmp, self.built_from)  # last: checksums of every file, what they were built from
            acc.wait_for_everyone()
            final = self.checkpoints.commit(state.step) if acc.is_main_process else None
        held = self._held_out_accuracy()  # every process: its share of the rows, in the sharded forward
        if final is not None:
            self._evaluate(final, state.step, held)  # its report and plots are written whole or refused in one line
            self.checkpoints.prune()
        acc.wait_for_everyone()

    def _held_out_accuracy(self) -> dict[str, float]:
        if self.held_out is None:
            return {}
        with evaluation_mode(self.module, self.target.model):
            return held_out_accuracy(self.module, self.held_out, self.accelerator, _pad_id(self.target))

    def _check_weights_finite(self, state: TrainerState) -> None:
        """Refuse to save NaN/inf weights as a checkpoint (a loss can still be finite the step the weights blow up).
        Collective, so every rank stops together."""
        bad = self._on_any_process(any(not bool(torch.isfinite(local_part(p).detach()).all())
                                       for p in self.module.parameters() if p.requires_grad))
        if bad:
            latest = self.checkpoints.latest()
            kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"
            raise DrafttrainError(
                f"the trained weights are not finite (NaN or inf) after step {state.step} (learning rate "
                f"{self.scheduler.get_last_lr()[0]:.3g}): not saved, training stopped; {kept}. Lower "
                "training.learning_rate or training.max_grad_norm"
            )

    def _evaluate(self, checkpoint: Path, step: int, held: dict[str, float]) -> None:
        measured = CheckpointMetrics(dict(held))
        with evaluation_mode(self.module, self.target.model):  # no dropout while measuring; training resumes as it was
            for callback in self.on_checkpoint:
                measured.merge(callback(step, checkpoint))
        if not measured.scalars:
            return
        with writing(checkpoint / EVAL_FILE, "the checkpoint's evaluation", after=f"; the checkpoint {checkpoint} "
                                                                                  "is complete: continue with --resume"):
            self.checkpoints.record_metrics(checkpoint, step, measured.scalars)
        if self.metrics is not None:
            self.metrics.write_eval(step, measured)

    def _log_best_checkpoint(self) -> None:
        """The best checkpoint (else the last) as a wandb artifact, when the recipe asks for it."""
        if self.metrics is None or not self.recipe.wandb.log_best_checkpoint:
            return
        best = self.checkpoints.best()
        checkpoint = self.checkpoints.root / best["checkpoint"] if best else self.checkpoints.latest()
        if checkpoint is not None:
            self.metrics.log_checkpoint(checkpoint, ["best" if best else "latest", checkpoint.name])

    def _result(self, state: TrainerState, losses: dict[int, float], trainable: int, resumed: Path | None):
        best = self.checkpoints.best()
        return TrainResult(
            steps=state.step,
            final_loss=losses[max(losses)] if losses else None,
            losses=losses,
            last_checkpoint=self.checkpoints.latest(),
            best_checkpoint=self.checkpoints.root / best["checkpoint"] if best else None,
            best=best,
            trainable_parameters=trainable,
            resumed_from=resumed,
            metrics_path=self.run.metrics,
        )


@contextlib.contextmanager
def evaluation_mode(*models: nn.Module):
    modes = [(m, m.training) for model in models for m in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _pad_id(target: Target) -> int:
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    return int(pad) if pad is not None else 0


def _as_float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)
