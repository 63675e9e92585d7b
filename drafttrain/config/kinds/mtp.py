"""The target's own multi-token-prediction layer's section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from drafttrain.config.draft import DraftConfig


class MtpConfig(DraftConfig):
    """The MTP layer a family ships (DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-Next, Qwen3.5), fine-tuned on the frozen
    target's outputs and drafting recursively, as vLLM runs it."""

    kind: Literal["mtp"] = "mtp"
    training_settings = frozenset({"steps", "step_decay", "ce_weight", "kl_weight"})
    # draft steps trained: the layer reused for the k-th draft token, each step reading the previous one's output and
    # attending to what it would see while decoding (FastMTP trains 3)
    steps: int = Field(3, ge=1)
    step_decay: float = Field(0.6, gt=0, le=1)  # step k's loss weighs step_decay**(k-1), normalised (FastMTP's beta)
    ce_weight: float = Field(1.0, ge=0)  # cross-entropy on the data's next tokens (the target's regenerated answers)
    kl_weight: float = Field(0.0, ge=0)  # KL(target || draft) to the target's own distribution at the same token
    # Start from the target: "native" (the MTP layer its checkpoint ships), "layer" (a fresh layer whose decoder layer
    # and final norm are the target's last); none: a fresh layer
    init_from_target: list[Literal["native", "layer"]] = ["native"]

    @model_validator(mode="after")
    def _one_start(self) -> "MtpConfig":
        if len(set(self.init_from_target)) > 1:
            raise ValueError("init_from_target: 'native' or 'layer', not both (the native layer holds a decoder layer "
                             "of its own)")
        if self.ce_weight == 0 and self.kl_weight == 0:
            raise ValueError("ce_weight and kl_weight are both 0: nothing would train")
        return self
