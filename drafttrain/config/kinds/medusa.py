"""Medusa heads' section (Medusa-2 with ``target_lora``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from drafttrain.config.draft import DraftConfig
from drafttrain.config.shared import TargetLora


class MedusaConfig(DraftConfig):
    """Medusa heads on the target's final hidden state; with ``target_lora``, Medusa-2 (the target trains with them)."""

    kind: Literal["medusa"] = "medusa"
    training_settings = frozenset({"loss_weight", "decay", "self_distill", "top_k", "init_lm_head_from_target"})
    renamed = {"lora": "target_lora"}
    num_heads: int = Field(4, ge=1)  # head i predicts the token i+2 positions ahead (the target itself: +1)
    num_layers: int = Field(1, ge=1)  # residual blocks (Linear + SiLU, with a skip) per head
    loss_weight: float = Field(0.2, gt=0)  # head i's loss weight is loss_weight * decay**i
    decay: float = Field(0.8, gt=0, le=1)  # loss weight of head k is decay ** k
    self_distill: bool = False  # soft targets: the target's own distribution instead of the data's token
    draft_vocab: str | None = None  # as for eagle3: default the run's draft_vocab.safetensors when it exists
    init_lm_head_from_target: bool = True  # each head's lm_head starts as the target's (its rows of the vocab)
    top_k: int = Field(5, ge=1)  # the k of the logged top-k accuracy per head (what tree candidates need)
    target_lora: TargetLora | None = None  # Medusa-2: LoRA adapters on the target, trained with the heads

    @property
    def trains_target(self) -> bool:
        return self.target_lora is not None

    def cannot_continue(self) -> str | None:
        return ("a Medusa-2 draft (its target's LoRA adapters, draft.target_lora) is not continued yet: its adapters "
                "load merged for serving") if self.target_lora is not None else None
