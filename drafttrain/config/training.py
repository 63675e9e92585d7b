"""The trainer's section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from drafttrain.config.base import Section


class TrainingConfig(Section):
    # online: the target runs every step; offline: prepare caches its states; stream: capture engines compute them
    # while training runs (capture section), nothing cached beyond a window of files
    hidden_states: Literal["online", "offline", "stream"] = "online"
    # the offline cache's hidden states: the target's dtype (auto: nothing lost), another, or float8 with a
    # per-token scale
    feature_dtype: Literal["auto", "float32", "bfloat16", "float16", "float8"] = "auto"
    # How prepare writes the offline cache. drafttrain: its own shards. speculators: speculators' layout, so its
    # trainer reads the cache too (`speculators train --data-path <run>/features`): a prepared dataset
    # (input_ids, loss_mask, seq_len) beside hidden_states/hs_{i}.safetensors for train row i (token_ids [T],
    # hidden_states [T, taps + 1, H]: the kind's taps, then the final state before the final norm)
    cache_layout: Literal["drafttrain", "speculators"] = "drafttrain"
    # A capture speculators made (its --data-path folder, or the hidden_states folder in it): prepare gives each
    # train row the file holding its token ids, and computes the rows none holds with the run's source (capture
    # section), written beside in speculators' layout. The files must hold the kind's taps then the final state
    cache_from: str | None = None
    cache_shard_rows: int = Field(256, gt=0)  # rows per offline-cache shard: the unit a rerun after a crash redoes
    epochs: float = Field(1.0, gt=0)  # passes over the train split
    max_steps: int | None = Field(None, gt=0)  # stop after this many optimizer steps (None: the epochs)
    # Train for this many minutes (training time: checkpoints and their evaluation not counted), the learning-rate
    # schedule running over the budget; epochs / max_steps still cap the run, and end the schedule if they come first.
    time_budget_minutes: float | None = Field(None, gt=0)
    batch_size: int = Field(1, gt=0)  # per device
    gradient_accumulation: int = Field(1, gt=0)  # micro-batches per optimizer step
    # micro-batches of rows of similar length, in a seeded order that still changes every epoch (HF Trainer's
    # group_by_length): less padding to compute when rows differ in length and a micro-batch holds several (what it
    # gains: docs/studies/eagle3_vs_references.md). No effect at batch_size 1 (nothing to pad); false: a uniformly
    # random order
    group_by_length: bool = True
    # How an optimizer step's micro-batches weigh: "micro_batch" (each micro-batch's token mean counts alike, the
    # accumulation averaging them) or "token" (every trained token of the step alike, across micro-batches and
    # ranks: HF Trainer's num_items_in_batch, what TRL's GKD trainer does). Differs when micro-batches hold unequal
    # numbers of trained tokens; measured against each other in docs/studies/eagle3_vs_references.md
    loss_reduction: Literal["micro_batch", "token"] = "micro_batch"
    # The loss mask moved this many positions later before the kind's loss: 0 trains a prediction when the token
    # predicted is an answer token (drafttrain's alignment); 1 when the token fed in is (speculators' alignment)
    loss_mask_shift: int = Field(0, ge=0, le=1)
    learning_rate: float = Field(1e-4, gt=0)  # AdamW's peak learning rate
    weight_decay: float = Field(0.0, ge=0)  # AdamW's weight decay
    warmup_steps: int = Field(0, ge=0)  # linear warm-up from 0
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"  # the learning rate after warm-up
    max_grad_norm: float = Field(0.5, gt=0)  # gradients clipped to this norm
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # bf16 or fp16 autocast (no: float32)
    deepspeed: str | None = None  # path to a DeepSpeed JSON config
    save_every: int = Field(100, gt=0)  # a checkpoint every this many steps (and at the end)
    keep_last: int = Field(2, gt=0)  # checkpoints kept besides the best
    # Eval metric whose highest-scoring checkpoint is kept as "best" and never pruned; None: real τ when
    # checkpoints are decoded, else the held-out accuracy's sim_tau (no validation split: no best tracking).
    best_metric: str | None = None
    log_every: int = Field(10, gt=0)  # a metrics record every this many steps
    num_workers: int = Field(0, ge=0)  # data loader worker processes

    def packages(self) -> list[tuple[str, str]]:
        return [("deepspeed", "deepspeed")] if self.deepspeed is not None else []

    @property
    def written_layout(self) -> str:
        """The layout prepare writes the offline cache in: speculators' whenever it joins a capture of speculators'."""
        return "speculators" if self.cache_from is not None else self.cache_layout

    @model_validator(mode="after")
    def _cache_layout_writable(self) -> "TrainingConfig":
        speculators = self.written_layout == "speculators"
        if speculators and self.feature_dtype == "float8":
            raise ValueError("training.feature_dtype float8 is drafttrain's own layout (a bfloat16 scale per tap and "
                             "token); speculators' layout holds bfloat16, float16 or float32: pick one of those")
        if speculators and self.hidden_states != "offline":
            raise ValueError("training.cache_layout speculators and training.cache_from are the offline cache's "
                             "settings: set training.hidden_states: offline")
        return self

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `no` (in a recipe or `training.mixed_precision=no`) as false
        return "no" if value is False else value
