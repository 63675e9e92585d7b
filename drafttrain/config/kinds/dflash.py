"""DFlash block drafters' section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from drafttrain.config.draft import DraftConfig
from drafttrain.config.shared import aux_layer_ids


class DFlashConfig(DraftConfig):
    """DFlash block drafting (arXiv 2602.06036): a small stack of draft layers reads the target's hidden states from
    several layers as context and predicts a block of tokens after an anchor in one forward."""

    kind: Literal["dflash"] = "dflash"
    training_settings = frozenset({"anchors", "weighting", "dpace_alpha", "decay_gamma", "init_from_target", "labels"})
    num_layers: int = Field(1, ge=1)  # decoder layers in the block drafter
    # the block: the anchor (a known token) and block_size - 1 mask tokens, each predicting the token at its position
    block_size: int = Field(8, ge=2)
    # target taps (HF hidden_states numbering, as for eagle3); default: inputs of layers 2, L/2 and L-3
    layers: list[int] | None = Field(None, min_length=1)
    draft_vocab: str | None = None  # as for eagle3: default the run's draft_vocab.safetensors when it exists
    anchors: int = Field(64, ge=1)  # blocks trained per row: random anchors among its trainable positions
    # how the block's positions are weighted in the loss: "dpace" (each by how much the expected acceptance length
    # depends on it, from the draft's own detached confidence: speculators' and SpecForge's best practice) or
    # "decay" (w_k = exp(-(k-1)/decay_gamma), the paper's)
    weighting: Literal["dpace", "decay"] = "dpace"
    dpace_alpha: float = Field(0.5, ge=0, le=1)  # D-PACE's smoothing: s_k = (1 - alpha) q_k + alpha
    decay_gamma: float = Field(4.0, gt=0)  # loss weight of slot k is exp(-(k-1) / gamma) (the decayed weighting)
    # what each slot learns: "soft" (cross-entropy against the target's distribution over the draft vocabulary: KL's
    # gradient, the tail included) or "argmax" (cross-entropy on the target's greedy token, all a greedy acceptance
    # needs: speculators' default beside D-PACE)
    labels: Literal["soft", "argmax"] = "soft"
    # attention inside the block: "bidirectional" (DFlash) or "causal" (speculators' default sliding layers)
    block_attention: Literal["bidirectional", "causal"] = "bidirectional"
    sample_from_anchor: bool = False  # DSpark's mode: every slot predicts, the anchor's included (block_size tokens)
    mask_token_id: int | None = None  # default: the tokenizer's mask token, else an unused embedding row, else unk/pad
    intermediate_size: int | None = Field(None, gt=0)  # the drafter's MLP width (None: the target's)
    # start the draft layers as copies of the target's last layers (q/k norms at one), its final norm, and fc passing
    # the last tap through, instead of noise. Off, as the references train (why: docs/studies/dflash_vs_references.md)
    init_from_target: bool = False

    _aux_layer_ids = field_validator("layers")(classmethod(lambda cls, layers: aux_layer_ids(layers)))
