"""The EAGLE-1 head's section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from drafttrain.config.draft import DraftConfig


class EagleConfig(DraftConfig):
    kind: Literal["eagle"] = "eagle"
    training_settings = frozenset({"regression_weight", "ce_weight", "noise", "init_from_target"})
    num_layers: int = Field(1, ge=1)  # decoder layers in the head
    regression_weight: float = Field(1.0, ge=0)  # weight of the hidden-state regression loss
    ce_weight: float = Field(0.1, ge=0)  # weight of the token cross-entropy loss
    noise: float = Field(0.2, ge=0)  # width of the uniform noise added to input features (EAGLE-1: 0.2)
    intermediate_size: int | None = Field(None, gt=0)  # the head's MLP width (None: the target's)
    # Start from the target: "layer" (the decoder layer from its last layer), "fc" (a pass-through of the hidden
    # state); EAGLE-1 uses the target's own lm_head already.
    init_from_target: list[Literal["layer", "fc"]] = []
