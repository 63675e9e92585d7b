"""What trains (the one frozen-target rule), the optimizer, the learning-rate schedule and the step budget."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from drafttrain import DrafttrainError
from drafttrain.config import TrainingConfig
from drafttrain.training.loader import BatchLayout


def total_steps(training: TrainingConfig, layout: BatchLayout) -> int:
    """Optimizer steps to run: max_steps when set, else the (possibly fractional) number of epochs (with a time
    budget: the most it may run)."""
    if training.max_steps is not None:
        return training.max_steps
    return max(1, math.ceil(training.epochs * layout.steps_per_epoch))


def select_trainable(target_model: nn.Module, drafter) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The one place that decides what trains: the drafter's own parameters, plus the target parameters its kind
    declares (``trainable_target_parameters``, e.g. LoRA adapters); every other target parameter is frozen here.

    Refuses a drafter that *registers* target weights as its own (checked by identity): they would be trained
    and saved with the draft although they belong to the target. Returns (draft parameters, target parameters).
    """
    target_params = dict(target_model.named_parameters())
    declared = set(drafter.trainable_target_parameters())
    unknown = sorted(declared - target_params.keys())
    if unknown:
        raise DrafttrainError(f"{type(drafter).__name__} declares target parameters the target lacks: {_few(unknown)}")
    for name, param in target_params.items():
        param.requires_grad_(name in declared)
    by_id = {id(p): name for name, p in target_params.items()}
    registered = [name for name, p in drafter.named_parameters() if id(p) in by_id]
    if registered:
        raise DrafttrainError(
            f"{type(drafter).__name__} registers target weights as its own parameters ({_few(registered)}): "
            "reference the target's modules without registering them, so they are neither trained nor saved"
        )
    own = [p for p in drafter.parameters() if p.requires_grad]
    trained = [target_params[n] for n in sorted(declared)]
    if not own and not trained:
        raise DrafttrainError(f"{type(drafter).__name__} has no trainable parameters")
    return own, trained


def build_optimizer(draft_params: list[nn.Parameter], target_params: list[nn.Parameter], training: TrainingConfig,
                    target_lr: float | None = None, target_start: int = 0) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases and norm gains (1-D tensors). Trained target parameters get their own
    learning rate and the step they start at (each group carries ``start_step`` for the schedule)."""
    groups = []
    for params, lr, start in ((draft_params, training.learning_rate, 0),
                              (target_params, target_lr or training.learning_rate, target_start)):
        for decays in (True, False):
            chosen = [p for p in params if (p.ndim >= 2) == decays]
            if chosen:
                groups.append({"params": chosen, "lr": lr, "start_step": start,
                               "weight_decay": training.weight_decay if decays else 0.0})
    return torch.optim.AdamW(groups, lr=training.learning_rate)


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig, num_steps: int,
                    clock: Callable[[], float] | None = None) -> LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine or linear decay to 0, or constant (transformers'
    formulas). The decay runs over ``num_steps``; with ``training.time_budget_minutes`` it runs over the budget
    too, read from ``clock()`` (training seconds so far), and whichever ends the run first ends the schedule: a run
    of any speed ends it on time, and one that runs out of epochs first ends it at its last step (it stopped at 5%
    of its peak rate when the budget outlasted the data)."""
    warmup = min(training.warmup_steps, num_steps)
    budget_s = training.time_budget_minutes * 60 if training.time_budget_minutes else None

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, num_steps - warmup)
        if budget_s is not None and clock is not None:
            progress = min(1.0, max(progress, clock() / budget_s))
        if training.scheduler == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        if training.scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    def group_factor(start: int):
        return lambda step: factor(step) if step >= start else 0.0

    return LambdaLR(optimizer, [group_factor(g.get("start_step", 0)) for g in optimizer.param_groups])


def _few(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
