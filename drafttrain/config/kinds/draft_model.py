"""A draft model's section (and PARD's, its variant: ``parallel``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from drafttrain.config.base import setting_error
from drafttrain.config.draft import DraftConfig
from drafttrain.config.shared import FLAT_PARALLEL_KEYS, DraftLora, ParallelDrafting, parallel_upgraded


class StudentLora(DraftLora):
    """LoRA adapters on a draft model (its student) instead of training all its weights: the student starts from
    pretrained weights, so they may adapt a fresh draft model."""

    target_modules: list[str] = Field(min_length=1)  # module names in the student, e.g. [q_proj, v_proj]
    dropout: float = Field(0.05, ge=0, lt=1)  # dropout on their input


class DraftModelConfig(DraftConfig):
    """A separate small causal LM trained to agree with the target (DistillSpec): a named model sharing the
    target's tokenizer (``student``), or one cut from the target's own layers (``cut``)."""

    kind: Literal["draft_model"] = "draft_model"
    training_settings = frozenset({"divergence", "beta", "temperature", "on_policy", "on_policy_max_new_tokens",
                                   "on_policy_temperature", "token_filter", "teacher_top_k"})
    renamed = {"lora": "draft_lora", **FLAT_PARALLEL_KEYS}
    builds_with_lora = True
    student: str | None = None  # a built-in name, model folder or Hub id with the target's tokenizer
    # ... or cut from the target, starting from its weights: "every:N" (layers 0, N, 2N, ...), "first:K", or a list
    # of layer indices (0-based)
    cut: str | list[int] | None = None
    # fkl / rkl / jsd / tvd: against the target's distribution; sft: cross-entropy on the data's tokens (the target's
    # answers, when regenerated)
    divergence: Literal["fkl", "rkl", "jsd", "tvd", "sft"] = "fkl"
    beta: float = Field(0.5, gt=0, lt=1)  # JSD(β): the mixture β·target + (1-β)·draft, as TRL's GKD defines it
    temperature: float = Field(1.0, gt=0)  # the temperature of both distributions in the divergence
    # λ of DistillSpec / GKD: this share of batches is answered by the current draft (sampled), scored by the target
    on_policy: float = Field(0.0, ge=0, le=1)
    on_policy_max_new_tokens: int = Field(128, gt=0)  # the length of the student's own answers (on-policy batches)
    on_policy_temperature: float = Field(1.0, ge=0)  # the student's sampling temperature for them
    # AdaSPEC-style selective distillation: leave out this share of each batch's tokens, those the draft finds
    # hardest (largest divergence), so its capacity goes to the tokens it can learn
    token_filter: float = Field(0.0, ge=0, lt=1)
    teacher_top_k: int = Field(64, gt=0)  # an offline teacher cache keeps this many logits per position
    draft_lora: StudentLora | None = None  # LoRA adapters on the student instead of all its weights
    # Served with a draft vocabulary: the draft_model proposer computes logits for these rows only (a cheaper
    # draft step; verification keeps it lossless). Default: the run's draft_vocab.safetensors when prepare wrote one.
    # The saved model stays a whole-vocabulary HF model for other engines.
    draft_vocab: str | None = None
    # "draft": train on the draft vocabulary's rows alone, as EAGLE-3 heads are: the student's logits and the
    # target's (renormalised) at those rows, at positions whose target argmax is one of them. The student's
    # lm_head and the divergence cost a fraction of the whole vocabulary's; the rows outside are left untrained,
    # so serve it with its draft vocabulary. "full": the whole vocabulary (engines without draft vocabularies).
    loss_vocab: Literal["full", "draft"] = "full"
    # PARD: parallel.depths draft tokens from one forward of the draft model (the accepted text, then mask tokens),
    # trained with the same divergence on COD-sampled mask slots (AMD's PARD); None: one token per forward
    parallel: ParallelDrafting | None = None

    @model_validator(mode="before")
    @classmethod
    def _parallel_count(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("parallel"), int):
            raise setting_error(f"parallel is now a section: parallel: {{depths: {values['parallel']}}}")
        return values

    @model_validator(mode="after")
    def _parallel(self) -> "DraftModelConfig":
        if self.parallel is not None and self.on_policy > 0:
            raise ValueError("parallel (PARD) trains on the data's answers: on_policy must be 0")
        return self

    @model_validator(mode="after")
    def _lora_on_a_new_student(self) -> "DraftModelConfig":
        if self.draft_lora is not None and self.init_from is not None:
            raise ValueError("draft_lora adapts a draft model as it is built (its student or cut); a continued draft "
                             "model (init_from) trains all its weights: leave draft_lora out")
        return self

    @classmethod
    def upgraded(cls, saved: dict[str, Any]) -> dict[str, Any]:
        return parallel_upgraded(super().upgraded(saved), "parallel")

    def cannot_continue(self) -> str | None:
        return ("a draft model trained through LoRA adapters (draft.draft_lora) is not continued yet: it loads merged; "
                "continue it as a whole model (leave draft.draft_lora out when it is first trained)") \
            if self.draft_lora is not None else None

    @model_validator(mode="after")
    def _one_student(self) -> "DraftModelConfig":
        if (self.student is None) == (self.cut is None):
            raise ValueError("give the draft model as either student (a model) or cut (layers of the target)")
        if isinstance(self.cut, str) and not re.fullmatch(r"(every|first):[1-9][0-9]*", self.cut):
            raise ValueError(f"cut {self.cut!r}: use every:N, first:K or a list of layer indices")
        if isinstance(self.cut, list) and (not self.cut or any(i < 0 for i in self.cut)
                                           or self.cut != sorted(set(self.cut))):
            raise ValueError(f"cut {self.cut}: layer indices must be ascending, unique and >= 0")
        return self
