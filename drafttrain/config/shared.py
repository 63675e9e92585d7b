"""Sub-sections more than one draft kind uses, under one name each: LoRA adapters and parallel drafting."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from drafttrain.config.base import Section


class LoraSettings(Section):
    """LoRA adapters (peft): which modules get them, their rank, scale and dropout."""

    needs = ("peft",)

    # module names (peft's matching: a name or its last part); None: every linear layer of the draft but its lm_head
    target_modules: list[str] | None = Field(None, min_length=1)
    rank: int = Field(16, gt=0)  # the adapters' rank
    alpha: float = Field(32.0, gt=0)  # their scale (alpha / rank)
    dropout: float = Field(0.0, ge=0, lt=1)  # dropout on their input


class DraftLora(LoraSettings):
    """``draft_lora``: LoRA adapters on a draft's own linear layers, its other weights frozen. Saved merged, so
    checkpoints and exports keep the kind's layout."""


class TargetLora(LoraSettings):
    """``target_lora``: LoRA adapters on the target, trained jointly with the draft (Medusa-2)."""

    target_modules: list[str] = Field(min_length=1)  # module names in the target, e.g. [q_proj, v_proj]
    rank: int = Field(8, gt=0)  # the adapters' rank
    alpha: float = Field(16.0, gt=0)  # their scale (alpha / rank)
    dropout: float = Field(0.05, ge=0, lt=1)  # dropout on their input
    learning_rate: float = Field(1e-4, gt=0)  # the adapters' (the heads use training.learning_rate, higher)
    heads_only_steps: int = Field(0, ge=0)  # stage 1: only the heads train for this many steps
    # The target's own loss: KL(original target || adapted target) on the training tokens, so its answers stay
    # close to the original; the heads' loss is added to it.
    kl_weight: float = Field(1.0, ge=0)
    save_merged: bool = False  # also save the adapted target merged into its weights, in every checkpoint


class ParallelDrafting(Section):
    """k >= 2 draft tokens from one forward: after the last real position, k - 1 mask slots each predict the token
    at their position; trained on COD-sampled rollouts (P-EAGLE for EAGLE-3 heads, PARD for draft models)."""

    training_settings = frozenset({"cod_ratio", "cod_min"})

    depths: int = Field(ge=2)  # tokens drafted per forward (k)
    cod_ratio: float = Field(0.7, gt=0, le=1)  # COD: depth d keeps max(cod_ratio**d, cod_min) of the rollouts
    cod_min: float = Field(0.2, ge=0, le=1)  # the least share of positions COD sampling keeps per depth
    # the mask slots' token: default the tokenizer's mask token, else an unused embedding row, else unk / pad
    mask_token_id: int | None = None

    @field_validator("depths", mode="before")
    @classmethod
    def _more_than_one(cls, depths: Any) -> Any:
        if depths == 1:
            raise ValueError("1 is one token per forward, what the kind does without parallel drafting: give 2 or "
                             "more, or leave parallel out")
        return depths


def aux_layer_ids(layers: list[int] | None) -> list[int] | None:
    """Target taps as vLLM and SGLang take them: ascending, unique, non-negative."""
    if layers is not None and (any(i < 0 for i in layers) or layers != sorted(set(layers))):
        raise ValueError(f"{layers}: aux layer ids must be ascending, unique and >= 0 (vLLM and SGLang "
                         "concatenate the taps in layer order)")
    return layers


# the parallel settings earlier versions kept flat in the kind's section, and where they are now
FLAT_PARALLEL_KEYS = {"cod_ratio": "parallel.cod_ratio", "cod_min": "parallel.cod_min",
                      "mask_token_id": "parallel.mask_token_id"}


def parallel_upgraded(saved: dict[str, Any], depths_key: str) -> dict[str, Any]:
    """A section saved with parallel drafting as flat keys (``depths_key``, cod_ratio, cod_min, mask_token_id),
    as earlier drafttrain versions saved it, with them as its ``parallel`` sub-section."""
    if not isinstance(saved.get(depths_key), int):
        return saved
    flat = {key: saved.pop(key) for key in (depths_key, *FLAT_PARALLEL_KEYS) if key in saved}
    depths = flat.pop(depths_key)
    saved["parallel"] = {"depths": depths, **flat} if depths else None
    return saved
