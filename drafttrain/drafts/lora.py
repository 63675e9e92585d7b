"""Draft LoRA: low-rank adapters (peft) on a draft's own linear layers, for adapting a trained draft with few
parameters (``draft.draft_lora``). The adapters live in the module while it trains (the optimizer and a resumed
run see them as they are); what is saved is the draft with each adapter merged into its layer, under the kind's own
weight names, so checkpoints, exports and every engine read it as any draft of its kind."""

from __future__ import annotations

import torch
from torch import nn

from drafttrain import DrafttrainError
from drafttrain.config import LoraSettings
from drafttrain.packages import require

ADAPTER = "default"  # peft's adapter name


def default_modules(drafter: nn.Module) -> list[str]:
    """Every linear layer of the draft but its lm_head (an output layer over the vocabulary, copied from the
    target or frozen by most kinds), by full name."""
    return [name for name, module in drafter.named_modules()
            if isinstance(module, nn.Linear) and "lm_head" not in name]


def add_draft_lora(drafter: nn.Module, lora: LoraSettings) -> None:
    """Wrap the draft's linear layers named by ``lora`` (default: :func:`default_modules`) in LoRA adapters, in
    place; every weight but the adapters' stops training."""
    peft = require("peft", "draft.draft_lora")
    LoraConfig, inject_adapter_in_model = peft.LoraConfig, peft.inject_adapter_in_model
    modules = lora.target_modules or default_modules(drafter)
    names = {name for name, _ in drafter.named_modules()}
    missing = [m for m in modules if not any(n == m or n.endswith("." + m) for n in names)]
    if missing:
        raise DrafttrainError(f"draft.draft_lora.target_modules {missing} are not modules of the "
                              f"{drafter.kind} draft (its linear layers: {', '.join(default_modules(drafter)[:12])})")
    inject_adapter_in_model(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                       target_modules=list(modules), bias="none"), drafter)
    for name, param in drafter.named_parameters():
        param.requires_grad_(".lora_" in name)


def _is_lora_layer(module: nn.Module) -> bool:
    # peft's LoraLayer, known by what it has, so that drafts without adapters never import peft
    return hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def has_lora(drafter: nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in drafter.modules())


@torch.no_grad()
def merged_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's state with every adapter merged into its layer (W + scale * B A) under the layer's own names:
    what a draft of its kind without adapters holds."""
    state = dict(drafter.state_dict())
    for name, module in drafter.named_modules():
        if not _is_lora_layer(module):
            continue
        prefix = f"{name}."
        base = module.get_base_layer()
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        state[prefix + "weight"] = base.weight + module.get_delta_weight(ADAPTER).to(base.weight.dtype)
        if base.bias is not None:
            state[prefix + "bias"] = base.bias
    return state
