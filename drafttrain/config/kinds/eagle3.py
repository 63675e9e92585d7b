"""The EAGLE-3 head's section (and P-EAGLE's, its variant: ``parallel``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from drafttrain.config.draft import DraftConfig
from drafttrain.config.shared import FLAT_PARALLEL_KEYS, ParallelDrafting, aux_layer_ids, parallel_upgraded


class Eagle3Config(DraftConfig):
    kind: Literal["eagle3"] = "eagle3"
    training_settings = frozenset({"ttt_steps", "step_decay", "noise", "init_from_target", "train_out_of_vocab"})
    renamed = {"parallel_depths": "parallel.depths", **FLAT_PARALLEL_KEYS}
    num_layers: int = Field(1, ge=1)  # decoder layers in the head
    # Target taps in HF hidden_states numbering (i = the input of layer i), ascending and unique, each below the
    # target's layer count: the order vLLM and SGLang concatenate them in. Default: inputs of 2, L/2, L-3.
    layers: list[int] | None = Field(None, min_length=1)
    # d2t/t2d mapping from `drafttrain prepare`; default <output_dir>/draft_vocab.safetensors when it exists,
    # else the full target vocabulary.
    draft_vocab: str | None = None
    ttt_steps: int = Field(7, ge=1)  # training-time test: draft positions unrolled in training
    step_decay: float = Field(0.8, gt=0, le=1)  # loss weight of unrolled step i is step_decay**i
    # Positions whose target argmax is outside the draft vocabulary can never be accepted: left out of the loss by
    # default (EAGLE-3's and SpecForge's choice); true trains them too, towards the target's distribution
    # renormalised over the draft vocabulary (speculators' choice)
    train_out_of_vocab: bool = False
    intermediate_size: int | None = Field(None, gt=0)  # the head's MLP width (None: the target's)
    # Start from the target instead of noise: "lm_head" (the target's lm_head rows of the draft vocabulary and its
    # final norm), "layer" (the decoder layer from the target's last layer), "fc" (a pass-through of the last tap).
    init_from_target: list[Literal["lm_head", "layer", "fc"]] = []
    noise: float = Field(0.0, ge=0)  # width of uniform noise added to the target taps while training (0: none)
    # P-EAGLE: parallel.depths draft tokens from one forward (mask slots after the last real pair), trained by COD
    # sampling instead of the training-time test (ttt_steps and step_decay are then not used); None: sequential
    parallel: ParallelDrafting | None = None
    # EAGLE-3.1 (speculators' fc_norm / norm_output, served by vLLM): an RMSNorm on each target tap before fc, so
    # taps of very different magnitudes reach fc alike; and the final norm's output, not the raw residual, fed back
    # as the next step's hidden, against the hidden's magnitude drifting over the unrolled steps and long contexts
    fc_norm: bool = False
    norm_output: bool = False  # EAGLE-3.1: a norm on the head's output hidden state
    # a sliding-window draft attention: each draft position reads the last sliding_window positions only (its own
    # included), so acceptance depends less on how long the context is; None: the whole context
    sliding_window: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _window(self) -> "Eagle3Config":
        if self.sliding_window is not None and self.parallel is not None:
            raise ValueError("sliding_window is for sequential EAGLE-3 heads, not P-EAGLE (parallel)")
        if self.sliding_window is not None and self.sliding_window <= self.ttt_steps:
            raise ValueError(f"sliding_window {self.sliding_window} must exceed ttt_steps {self.ttt_steps}: a draft "
                             "position must see the tokens it drafted itself")
        return self

    @classmethod
    def upgraded(cls, saved: dict[str, Any]) -> dict[str, Any]:
        return parallel_upgraded(saved, "parallel_depths")

    _aux_layer_ids = field_validator("layers")(classmethod(lambda cls, layers: aux_layer_ids(layers)))

