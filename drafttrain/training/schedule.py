"""Optimizer, learning-rate schedule and step budget, plus the check that the target stays frozen."""

from __future__ import annotations

import math

import torch
from torch import nn

from drafttrain import DrafttrainError
from drafttrain.config import TrainingConfig
from drafttrain.training.loader import BatchLayout

# Recipe name -> transformers.get_scheduler name. "constant" keeps the warmup, as the others do.
_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def total_steps(training: TrainingConfig, layout: BatchLayout) -> int:
    """Optimizer steps to run: max_steps when set, else the (possibly fractional) number of epochs."""
    if training.max_steps is not None:
        return training.max_steps
    return max(1, math.ceil(training.epochs * layout.steps_per_epoch))


def trainable_parameters(draft: nn.Module) -> list[nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]


def build_optimizer(draft: nn.Module, training: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over the draft's trainable parameters; no weight decay on biases and norm gains (1-D tensors)."""
    params = trainable_parameters(draft)
    if not params:
        raise DrafttrainError(f"{type(draft).__name__} has no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": training.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=training.learning_rate)


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig, num_steps: int):
    from transformers import get_scheduler

    return get_scheduler(
        _SCHEDULERS[training.scheduler],
        optimizer=optimizer,
        num_warmup_steps=min(training.warmup_steps, num_steps),
        num_training_steps=num_steps,
    )


def check_target_frozen(target_model: nn.Module, draft: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Refuse to train if any target weight could change or be saved with the draft.

    Returns the number of trainable draft parameters. Checked by identity, so a draft that *registers* the
    target's embedding or lm_head (instead of referencing it) is caught even though the tensors are frozen.
    """
    target_params = {id(p): name for name, p in target_model.named_parameters()}
    thawed = [name for name, p in target_model.named_parameters() if p.requires_grad]
    if thawed:
        raise DrafttrainError(f"target parameters require grad (the target must be frozen): {_few(thawed)}")
    registered = [name for name, p in draft.named_parameters() if id(p) in target_params]
    if registered:
        raise DrafttrainError(
            f"{type(draft).__name__} registers target weights as its own parameters ({_few(registered)}): "
            "reference the target's modules without registering them, so they are neither trained nor saved"
        )
    in_optimizer = [target_params[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in target_params]
    if in_optimizer:
        raise DrafttrainError(f"target parameters are in the optimizer: {_few(in_optimizer)}")
    return sum(p.numel() for g in optimizer.param_groups for p in g["params"])


def _few(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
