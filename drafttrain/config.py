"""The one typed recipe schema. Every stage reads its section from here; nothing reads raw YAML.

Recipes are validated in full before any work starts: unknown keys and wrong types are rejected with the
dotted path of the offending field. ``key.sub=value`` overrides from the CLI are applied before validation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from drafttrain import DrafttrainError
from drafttrain.packages import check_installed
from drafttrain.sampling import check_sampling


class Section(BaseModel):
    # Unknown keys are errors, and so are inf / nan anywhere: a number that can only fail later fails now.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # the packages a section needs whenever it is present in a recipe (peft for a LoRA section)
    needs: ClassVar[tuple[str, ...]] = ()

    def packages(self) -> list[tuple[str, str]]:
        """(field, module) for each package this section needs as set ("" names the section itself)."""
        return [("", module) for module in self.needs]


def needed_packages(section: Section, path: str = "") -> list[tuple[str, str]]:
    """(recipe field, module) for every package a recipe (or any section) needs as set, nested sections included."""
    out = [(".".join(p for p in (path, field) if p), module) for field, module in section.packages()]
    for name in type(section).model_fields:
        value = getattr(section, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, child in items:
            if isinstance(child, Section):
                where = ".".join(p for p in (path, name, None if index is None else str(index)) if p)
                out += needed_packages(child, where)
    return out


class TargetConfig(Section):
    # A built-in name (see drafttrain.targets.BUILTIN_TARGETS), a Hub id, a local folder, or a .gguf file.
    model: str = "smollm2-135m-instruct"
    revision: str | None = None  # a Hub revision (branch, tag or commit)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # the dtype the target's weights load in
    device: str = "cpu"  # cpu, cuda, cuda:N, or "auto" (spread over the GPUs, then CPU)
    trust_remote_code: bool = False  # run the model's own code from the Hub (off unless asked)
    # Override the tokenizer's chat template: a Jinja string or a path to a .jinja file.
    chat_template: str | None = None
    # A fine-tune of ``model`` given as a peft LoRA adapter folder: loaded onto it and merged, so the target is the
    # fine-tuned model (its name and fingerprint say so; a draft trained for the base is re-aligned to it)
    adapter: str | None = None

    def packages(self) -> list[tuple[str, str]]:
        return [("adapter", "peft")] if self.adapter is not None else []


class SourceConfig(Section):
    path: str  # local file (json/jsonl/parquet, optionally .gz) or a Hub dataset id
    # request_log: served traffic (OpenAI-format request/response logs); prompts: a prompts file (data/traffic.py)
    format: Literal["auto", "sharegpt", "openai", "alpaca", "fastchat", "gsm8k", "mbpp", "self_instruct",
                    "request_log", "prompts"] = "auto"
    split: str = "train"  # Hub datasets only
    subset: str | None = None  # Hub dataset config name
    weight: float = Field(1.0, gt=0)  # share of data.num_samples, relative to the other sources
    max_samples: int | None = Field(None, gt=0)  # hard cap on rows taken from this source
    # None: follow regenerate.enabled. False: keep this source's own answers, so a large written corpus can be mixed
    # with a smaller share the target re-answers (regeneration is the slow stage on small machines).
    regenerate: bool | None = None
    # A request log written by `drafttrain eval --feedback` (the closed loop): the loss weight of each answer token
    # the target put in place of draft tokens it refused, where the draft most needs to learn (1: no weighting)
    rejected_weight: int = Field(1, ge=1, le=100)

    @model_validator(mode="after")
    def _weights_from_a_log(self) -> "SourceConfig":
        if self.rejected_weight != 1 and self.format != "request_log":
            raise ValueError(f"rejected_weight is for a request log written by `drafttrain eval --feedback` "
                             f"(format: request_log), not format {self.format!r}")
        return self


class ReplayConfig(Section):
    """Rows of an earlier run's train split mixed into this one, so a draft adapted to new data (draft.init_from)
    keeps what it learnt there: the same tokenizer, taken as they were tokenised (nothing is re-answered)."""

    run: str  # the earlier run's output_dir (its data/train split and manifest)
    fraction: float = Field(gt=0, lt=1)  # the replayed rows' share of the final train split


class DataConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1)  # the sources mixed by weight
    num_samples: int | None = Field(None, gt=0)  # total conversations after mixing; None = all
    dedupe: bool = True  # drop a conversation that occurs twice in the pool
    validation_fraction: float = Field(0.05, ge=0, lt=1)  # held out: chooses checkpoints by real τ
    max_length: int = Field(2048, gt=8)  # tokens per row; longer rows are cut
    # Conversations longer than max_length are cut (keeping what fits) or dropped (counted in the summary).
    overlength: Literal["truncate", "drop"] = "truncate"
    packing: bool = False  # pack several conversations per row (document-aware position ids)
    cache_dir: str | None = None  # default: <output_dir>/cache
    replay: ReplayConfig | None = None  # rows of an earlier run mixed back in (continuing a draft)


class RegenerateConfig(Section):
    enabled: bool = True  # the target answers every conversation again (its own distribution)
    backend: Literal["hf", "openai"] = "hf"  # hf: in this process; openai: a vLLM or SGLang server
    base_url: str | None = None  # OpenAI-compatible server (vLLM / SGLang), backend=openai
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never from the recipe
    served_model: str | None = None  # model name on the server; default: target.model
    temperature: float = Field(0.0, ge=0)  # 0: greedy answers
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling of the answers
    max_new_tokens: int = Field(256, gt=0)  # the longest answer
    batch_size: int = Field(8, gt=0)  # conversations answered together
    # hf backend: a batch also holds at most this many tokens, rows x (its longest prompt + max_new_tokens), what its
    # KV cache holds: long prompts then share smaller batches instead of running out of memory. None: no limit.
    max_batch_tokens: int | None = Field(None, gt=0)
    # Keep the dataset's response when the target's answer is empty (counted), instead of dropping the row.
    keep_original_on_empty: bool = False
    # Reuse answers the same target gave with the same settings in earlier runs (the answer store in the cache).
    reuse_answers: bool = True

    @model_validator(mode="after")
    def _server_named(self) -> "RegenerateConfig":
        if self.backend == "openai" and not self.base_url:
            raise ValueError("base_url is required when backend is 'openai' (the server, e.g. "
                             "http://localhost:8000/v1)")
        if self.base_url is not None and not re.match(r"https?://[^/\s]+", self.base_url):
            raise ValueError(f"base_url {self.base_url!r} is not an http(s) URL")
        return self


class DraftVocabConfig(Section):
    # With draft.init_from (kinds that can adopt one): the continued draft's own tokens and every token the new data
    # trains on that it lacks, whatever size and coverage say (their output rows start as the target's)
    enabled: bool = False
    size: int = Field(32000, gt=0)  # the number of draft tokens (with coverage: the most)
    # Size it by measurement instead: the fewest most-frequent tokens that cover this share of the trainable
    # tokens of the train split (rounded up to a multiple of 64), at most ``size``.
    coverage: float | None = Field(None, gt=0, le=1)


class DraftLoraConfig(Section):
    """LoRA adapters (peft) on a draft's own linear layers: a trained draft adapted by few parameters, its other
    weights frozen. Saved merged, so checkpoints and exports keep the kind's layout."""

    needs = ("peft",)

    # module names (peft's matching: a name or its last part); None: every linear layer of the draft but its lm_head
    target_modules: list[str] | None = Field(None, min_length=1)
    rank: int = Field(16, gt=0)  # the adapters' rank
    alpha: float = Field(32.0, gt=0)  # their scale (alpha / rank)
    dropout: float = Field(0.0, ge=0, lt=1)  # dropout on their input


class DraftConfig(Section):
    """Base of every draft kind's section; ``kind`` picks the section (and the registry entry in drafttrain.drafts)."""

    kind: str  # the draft kind: eagle3, eagle, medusa, draft_model, dflash
    # Continue training a saved draft of this kind (a checkpoint, a run folder, an export or what `drafttrain
    # import` wrote) instead of a fresh one: its architecture and draft vocabulary are kept; of this section only
    # the settings that shape the loss (``training_settings``) may differ from it, the rest must agree or be left out.
    init_from: str | None = None
    draft_lora: DraftLoraConfig | None = None  # train LoRA adapters on a continued draft instead of all its weights
    # the settings a continued draft may change: they shape the training loss, not the weights
    training_settings: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _lora_continues(self) -> "DraftConfig":
        if self.draft_lora is not None and self.init_from is None:
            raise ValueError("draft_lora adapts a trained draft through low-rank adapters: name it in draft.init_from "
                             "(on a fresh draft they would train around frozen random weights)")
        return self

    def cannot_continue(self) -> str | None:
        """Why a saved draft of this section cannot be continued by draft.init_from (None: it can)."""
        return None

    @property
    def trains_target(self) -> bool:
        """Whether this draft trains part of the target (then the target must run online, inside the step)."""
        return False


class Eagle3Config(DraftConfig):
    kind: Literal["eagle3"] = "eagle3"
    training_settings = frozenset({"ttt_steps", "step_decay", "noise", "cod_ratio", "cod_min", "init_from_target",
                                   "train_out_of_vocab"})
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
    # P-EAGLE: k >= 2 draft tokens from one forward (mask slots after the last real pair), trained by COD sampling
    # instead of the training-time test (ttt_steps and step_decay are then not used); 0: sequential EAGLE-3
    parallel_depths: int = Field(0, ge=0)
    cod_ratio: float = Field(0.7, gt=0, le=1)  # COD: depth d keeps max(cod_ratio**d, cod_min) of the rollouts
    cod_min: float = Field(0.2, ge=0, le=1)  # P-EAGLE: the least share of positions COD sampling keeps per depth
    mask_token_id: int | None = None  # P-EAGLE's mask token (default as for dflash)
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
        if self.sliding_window is not None and self.parallel_depths:
            raise ValueError("sliding_window is for sequential EAGLE-3 heads, not P-EAGLE (parallel_depths)")
        if self.sliding_window is not None and self.sliding_window <= self.ttt_steps:
            raise ValueError(f"sliding_window {self.sliding_window} must exceed ttt_steps {self.ttt_steps}: a draft "
                             "position must see the tokens it drafted itself")
        return self

    @field_validator("parallel_depths")
    @classmethod
    def _parallel(cls, depths: int) -> int:
        if depths == 1:
            raise ValueError("parallel_depths 1 is one token per forward, what EAGLE-3 does already: give 0 (off) or >= 2")
        return depths

    @field_validator("layers")
    @classmethod
    def _aux_layer_ids(cls, layers: list[int] | None) -> list[int] | None:
        if layers is not None and (any(i < 0 for i in layers) or layers != sorted(set(layers))):
            raise ValueError(f"{layers}: aux layer ids must be ascending, unique and >= 0 (vLLM and SGLang "
                             "concatenate the taps in layer order)")
        return layers


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


class LoraConfig(Section):
    """LoRA adapters on the target (through peft), trained jointly with the draft (Medusa-2)."""

    needs = ("peft",)

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


class MedusaConfig(DraftConfig):
    """Medusa heads on the target's final hidden state; with ``lora``, Medusa-2 (the target trains with them)."""

    kind: Literal["medusa"] = "medusa"
    training_settings = frozenset({"loss_weight", "decay", "self_distill", "top_k", "init_lm_head_from_target"})
    num_heads: int = Field(4, ge=1)  # head i predicts the token i+2 positions ahead (the target itself: +1)
    num_layers: int = Field(1, ge=1)  # residual blocks (Linear + SiLU, with a skip) per head
    loss_weight: float = Field(0.2, gt=0)  # head i's loss weight is loss_weight * decay**i
    decay: float = Field(0.8, gt=0, le=1)  # loss weight of head k is decay ** k
    self_distill: bool = False  # soft targets: the target's own distribution instead of the data's token
    draft_vocab: str | None = None  # as for eagle3: default the run's draft_vocab.safetensors when it exists
    init_lm_head_from_target: bool = True  # each head's lm_head starts as the target's (its rows of the vocab)
    top_k: int = Field(5, ge=1)  # the k of the logged top-k accuracy per head (what tree candidates need)
    lora: LoraConfig | None = None  # Medusa-2: LoRA adapters on the target, trained with the heads

    @property
    def trains_target(self) -> bool:
        return self.lora is not None

    def cannot_continue(self) -> str | None:
        return ("a Medusa-2 draft (its target's LoRA adapters, draft.lora) is not continued yet: its adapters load "
                "merged for serving") if self.lora is not None else None


class StudentLoraConfig(Section):
    """LoRA adapters on a draft model (through peft) instead of training all its weights (the draft model's own
    draft LoRA: ``draft_lora`` is for the kinds that run on the target's hidden states)."""

    needs = ("peft",)

    target_modules: list[str] = Field(min_length=1)  # module names in the student, e.g. [q_proj, v_proj]
    rank: int = Field(16, gt=0)  # the adapters' rank
    alpha: float = Field(32.0, gt=0)  # their scale (alpha / rank)
    dropout: float = Field(0.05, ge=0, lt=1)  # dropout on their input


class DraftModelConfig(DraftConfig):
    """A separate small causal LM trained to agree with the target (DistillSpec): a named model sharing the
    target's tokenizer (``student``), or one cut from the target's own layers (``cut``)."""

    kind: Literal["draft_model"] = "draft_model"
    training_settings = frozenset({"divergence", "beta", "temperature", "on_policy", "on_policy_max_new_tokens",
                                   "on_policy_temperature", "token_filter", "teacher_top_k", "cod_ratio", "cod_min"})
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
    lora: StudentLoraConfig | None = None  # LoRA adapters on the student instead of all its weights
    # Served with a draft vocabulary: the draft_model proposer computes logits for these rows only (a cheaper
    # draft step; verification keeps it lossless). Default: the run's draft_vocab.safetensors when prepare wrote one.
    # The saved model stays a whole-vocabulary HF model for other engines.
    draft_vocab: str | None = None
    # "draft": train on the draft vocabulary's rows alone, as EAGLE-3 heads are: the student's logits and the
    # target's (renormalised) at those rows, at positions whose target argmax is one of them. The student's
    # lm_head and the divergence cost a fraction of the whole vocabulary's; the rows outside are left untrained,
    # so serve it with its draft vocabulary. "full": the whole vocabulary (engines without draft vocabularies).
    loss_vocab: Literal["full", "draft"] = "full"
    # PARD: k >= 2 draft tokens from one forward of the draft model (the accepted text, then k - 1 mask tokens),
    # trained with the same divergence on COD-sampled mask slots (AMD's PARD); 0: one token per forward
    parallel: int = Field(0, ge=0)
    cod_ratio: float = Field(0.7, gt=0, le=1)  # COD: depth d keeps max(cod_ratio**d, cod_min) of the rollouts
    cod_min: float = Field(0.2, ge=0, le=1)  # PARD: the least share of positions COD sampling keeps per depth
    mask_token_id: int | None = None  # PARD's mask token (default as for dflash)

    @model_validator(mode="after")
    def _parallel(self) -> "DraftModelConfig":
        if self.parallel == 1:
            raise ValueError("parallel 1 is one token per forward, what a draft model does already: 0 (off) or >= 2")
        if self.parallel and self.on_policy > 0:
            raise ValueError("parallel (PARD) trains on the data's answers: on_policy must be 0")
        return self

    def cannot_continue(self) -> str | None:
        return ("a draft model trained through LoRA adapters (draft.lora) is not continued yet: it loads merged; "
                "continue it as a whole model (leave draft.lora out when it was first trained)") \
            if self.lora is not None else None

    @model_validator(mode="after")
    def _student_lora(self) -> "DraftModelConfig":
        if self.draft_lora is not None:
            raise ValueError("a draft model's LoRA is draft.lora (adapters on its student), not draft_lora")
        return self

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

    @field_validator("layers")
    @classmethod
    def _aux_layer_ids(cls, layers: list[int] | None) -> list[int] | None:
        return Eagle3Config._aux_layer_ids(layers)


# The draft section is one of the kinds' sections, chosen by its ``kind``: the built-in kinds' here, and any other
# kind's added when drafttrain.drafts.registry.register_kind registers it (tests tie these to the registry).
DRAFT_SECTIONS: list[type[DraftConfig]] = [Eagle3Config, EagleConfig, MedusaConfig, DraftModelConfig, DFlashConfig]
DRAFT_KINDS: list[str] = [section.model_fields["kind"].default for section in DRAFT_SECTIONS]


def _draft_section() -> Any:
    return Annotated[Union[tuple(DRAFT_SECTIONS)], Field(discriminator="kind")]


DraftSection = _draft_section()


class TrainingConfig(Section):
    # online: the target runs every step; offline: prepare caches its states
    hidden_states: Literal["online", "offline"] = "online"
    # dtype of the offline cache's hidden states; auto = the target's own dtype (nothing lost)
    # the offline cache's hidden states: the target's dtype (auto), another, or float8 with a per-token scale
    feature_dtype: Literal["auto", "float32", "bfloat16", "float16", "float8"] = "auto"
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

    def packages(self) -> list[tuple[str, str]]:
        return [("deepspeed", "deepspeed")] if self.deepspeed is not None else []
    save_every: int = Field(100, gt=0)  # a checkpoint every this many steps (and at the end)
    keep_last: int = Field(2, gt=0)  # checkpoints kept besides the best
    # Eval metric (returned by the on_checkpoint callbacks) whose highest-scoring checkpoint is kept as "best"
    # and never pruned; None: no best tracking.
    best_metric: str | None = None
    log_every: int = Field(10, gt=0)  # a metrics record every this many steps
    num_workers: int = Field(0, ge=0)  # data loader worker processes

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `no` (in a recipe or `training.mixed_precision=no`) as false
        return "no" if value is False else value


SETTING_ERROR = "setting"  # pydantic error type whose message continues the setting's name ("--depth (k) must ...")


def _setting_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(SETTING_ERROR, message)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _setting_error(f"must be positive, got {value!r}")
    return value


class DecodeSettings(Section):
    """How speculative decoding runs, built and validated once: from a recipe's eval section or from the flags of
    ``drafttrain eval`` (which fill this schema), or with :meth:`of` by a library caller. The engine, the auto
    choice and ``evaluate()`` take it as it is."""

    # inf / nan reach check_sampling, whose message names the rule; tree shapes from library callers are objects
    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True,
                              allow_inf_nan=True)

    # The descriptions are the help of `drafttrain eval`'s flags (generated from these fields) and the recipe
    # reference's text alike.
    depth: int | Literal["auto"] = Field(5, description=(
        'chain length / tree depth; "auto" chooses the chain depth and a confidence threshold from this machine\'s '
        "measured costs and the draft's acceptance on held-out prompts (drafttrain.decoding.autodepth)"))
    max_depth: int = Field(8, description='the deepest chain "auto" considers')
    min_confidence: float = Field(0.0, description="stop a chain once the draft is this unsure (0: never)")
    tree: Any = Field("chain", description=(
        "chain | dynamic (EAGLE-2) | auto | a named static tree (medusa-16, ...) | a .json file of paths | "
        "static:PATHS; library callers may also give a list of paths or a shape object (drafttrain.decoding.trees)"))
    total_tokens: int = Field(60, description="dynamic tree: nodes verified per step")
    tree_top_k: int = Field(10, description="dynamic tree: children expanded per node")
    temperature: float = Field(0.0, description=(
        "0: greedy (lossless token for token); above: sampling (Leviathan/Chen)"))
    top_p: float = Field(1.0, description="sampling's nucleus")
    top_k: int = Field(0, description="sampling's top-k (0: off)")
    seed: int = Field(0, description="sampling's seed per prompt")
    max_new_tokens: int = Field(64, description="per turn")
    runtime_check: bool = Field(True, description=(
        "an auto choice that speculates is checked while decoding and falls back (to a shallower chain, or plain "
        "decoding) when it does not pay on this machine now (drafttrain.decoding.guard); a fixed depth is never "
        "changed"))

    @field_validator("depth", mode="before")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _setting_error(f"(k) must be positive, or 'auto'; got {value!r}")
        return value

    _positive = field_validator("max_depth", "total_tokens", "tree_top_k", "max_new_tokens", mode="before")(
        classmethod(lambda cls, value: _positive_int(value)))

    @field_validator("min_confidence")
    @classmethod
    def _confidence(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise _setting_error(f"must be in [0, 1), got {value!r}")
        return value

    @field_validator("tree")
    @classmethod
    def _tree(cls, value: Any) -> Any:
        if not isinstance(value, (str, list, tuple)) and not hasattr(value, "depth"):
            raise _setting_error(f"must be a tree spec (chain, dynamic, auto, medusa-16, ...), a list of paths or a "
                                 f"tree shape, got {value!r}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> "DecodeSettings":
        try:
            check_sampling(self.temperature, self.top_p, self.top_k)
        except DrafttrainError as err:
            raise _setting_error(str(err)) from None
        if self.depth == "auto" and self.tree != "chain":
            raise _setting_error("depth auto chooses chain depths: use tree chain (the default), or give a depth")
        return self

    @property
    def deepest(self) -> int:
        """The deepest chain these settings may draft: the depth, or under "auto" the deepest it considers."""
        return self.max_depth if self.depth == "auto" else self.depth

    @property
    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @classmethod
    def of(cls, settings: "DecodeSettings | None" = None, /, **changes: Any) -> "DecodeSettings":
        """``settings`` (or the defaults) with ``changes``, validated; a bad value is a DrafttrainError naming it."""
        values = {name: getattr(settings, name) for name in cls.model_fields} if settings is not None else {}
        try:
            return cls.model_validate({**values, **changes})
        except ValidationError as err:
            raise DrafttrainError(describe_errors(err, lambda loc: ".".join(map(str, loc)))) from None

    def fitted_to(self, deepest: int | None) -> "DecodeSettings":
        """These settings with a default depth, or the default deepest depth "auto" considers, lowered to what the
        draft can fill (``deepest``; None: any). A depth the user gave is kept as it is (and refused, naming both,
        when it is deeper)."""
        if deepest is None:
            return self
        if self.depth == "auto":
            if "max_depth" in self.model_fields_set or self.max_depth <= deepest:
                return self
            return type(self).of(self, max_depth=deepest)  # a DFlash block of 8 fills 7, under auto's default 8
        if "depth" in self.model_fields_set or self.depth <= deepest:
            return self
        return type(self).of(self, depth=deepest)

    def decode_settings(self) -> "DecodeSettings":
        """Only the decode settings (a subclass's other fields left out)."""
        return DecodeSettings.of(self)


class EvalConfig(DecodeSettings):
    """The recipe's eval section: the prompts, and how to decode them."""

    suite: str = Field("mt_bench", description="the prompts reported on: a built-in suite or a FastChat .jsonl")
    num_prompts: int | None = Field(8, description=(
        "how many questions are reported on, taken one category at a time in turn (each category's in file order, "
        "so a few cover every category); None: every question of the suite"))

    @field_validator("num_prompts", mode="before")
    @classmethod
    def _num_prompts(cls, value: Any) -> Any:
        return None if value is None else _positive_int(value)

    every_checkpoint: bool = True  # measure τ and speedup on held-out prompts at every checkpoint
    # a checkpoint evaluation during training starts no new prompt after this many minutes, and says it ran over
    # (a busy machine once made a 4-prompt evaluation take 15 minutes); None: no budget
    checkpoint_budget_minutes: float | None = Field(5.0, gt=0)


class BenchConfig(Section):
    """``drafttrain bench``: how the engine is driven, level by level (the flags fill this schema)."""

    engine: Literal["vllm", "sglang"] = "vllm"
    concurrency: list[int] = [1, 2, 4, 8, 16, 32]
    # draft lengths the engine is served with (one server each); the report says which pays at each level
    num_speculative_tokens: list[int] = [3]
    # requests per level: at least this many, and at least ``requests_per_stream`` per concurrent stream, so every
    # level runs long enough to leave its ramp-up behind
    min_requests: int = 8
    requests_per_stream: int = 2
    output_len: int = 128
    temperature: float = Field(0.0, ge=0)
    num_prompts: int | None = None  # how many of the suite's questions to take (None: every one)
    # τ by the engine and by our evaluator at concurrency 1, T=0: the tolerance of their difference (vLLM and our
    # proposer both draft by argmax, so only a near-tie flipped by different kernels separates them)
    agreement_tolerance: float = Field(0.03, ge=0)
    # a draft "pays" at a level only when its output tokens/s beat plain serving's by more than this share (and by
    # more than plain serving's own spread between passes, when there are several): a side that never drafts can
    # measure several percent above plain serving
    pays_margin: float = Field(0.03, ge=0)
    # the share of the machine's (or GPU's) memory all servers of one bench together may hold
    memory_fraction: float = Field(0.8, gt=0, le=1)
    port: int = Field(8100, gt=0, lt=65536)
    # float32 by default, as drafttrain's evaluator computes, so the one-stream agreement check compares like with
    # like; a GPU user serving bfloat16 says so here
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    server_args: list[str] = []  # passed to every server as they are (--enforce-eager, --max-model-len 4096, ...)
    startup_timeout_s: float = Field(900.0, gt=0)
    repeats: int = 1  # passes over the levels; sides alternate their order pass by pass and level by level

    @field_validator("concurrency", "num_speculative_tokens")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if not value:
            raise _setting_error("must name at least one value")
        return sorted({_positive_int(v) for v in value})

    @field_validator("min_requests", "requests_per_stream", "output_len", "repeats")
    @classmethod
    def _positive(cls, value: Any) -> int:
        return _positive_int(value)

    @field_validator("num_prompts", mode="before")
    @classmethod
    def _num_prompts(cls, value: Any) -> Any:
        return None if value is None else _positive_int(value)

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_stream * concurrency)


class WandbConfig(Section):
    enabled: bool = True  # log to Weights & Biases
    project: str = "drafttrain"  # its project name
    # "offline" unless WANDB_API_KEY is set; "disabled" turns it off.
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    # Upload the best checkpoint's draft (not its optimizer state) as a wandb model artifact when training ends.
    log_best_checkpoint: bool = False

    def resolved_mode(self, environ: Mapping[str, str] = os.environ) -> str:
        """online / offline / disabled. The environment (WANDB_MODE, WANDB_DISABLED) wins over the recipe, so
        tests and CI can switch it off; ``auto`` is offline unless an API key is present."""
        env_mode = environ.get("WANDB_MODE", "").strip().lower()
        if not self.enabled or self.mode == "disabled" or env_mode == "disabled":
            return "disabled"
        if environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes"):
            return "disabled"
        if env_mode in ("online", "offline"):
            return env_mode
        if self.mode == "auto":
            return "online" if environ.get("WANDB_API_KEY") else "offline"
        return self.mode

    def packages(self) -> list[tuple[str, str]]:
        return [] if self.resolved_mode() == "disabled" else [("mode", "wandb")]


class Recipe(Section):
    output_dir: str = "runs/default"  # the run folder: data, checkpoints, reports, logs
    seed: int = 0  # seeds data order, sampling and initialisation
    target: TargetConfig = TargetConfig()  # the model the draft serves
    data: DataConfig | None = None  # the conversations to train on (prepare); None for a recipe that only evaluates
    regenerate: RegenerateConfig = RegenerateConfig(enabled=False)  # answers regenerated by the target
    draft_vocab: DraftVocabConfig = DraftVocabConfig()  # the draft vocabulary (d2t / t2d) built from the data
    draft: DraftSection | None = None  # the draft: its kind and that kind's settings
    training: TrainingConfig = TrainingConfig()  # the trainer
    eval: EvalConfig = EvalConfig()  # the evaluation of every checkpoint and of the final draft
    wandb: WandbConfig = WandbConfig()  # logging to Weights & Biases

    @model_validator(mode="after")
    def _trained_target_runs_online(self) -> "Recipe":
        if self.draft is not None and self.draft.trains_target and self.training.hidden_states == "offline":
            raise ValueError("training.hidden_states offline: this draft trains the target (draft.lora), so the "
                             "target's outputs change every step and cannot be cached; use online")
        return self

    @model_validator(mode="after")
    def _vocab_needs_data(self) -> "Recipe":
        if self.draft_vocab.enabled and self.data is None:
            raise ValueError("draft_vocab.enabled needs a data section to count token frequencies over")
        return self

    @model_validator(mode="after")
    def _source_regeneration(self) -> "Recipe":
        if self.data is None or self.regenerate.enabled:
            return self
        asking = [s.path for s in self.data.sources if s.regenerate]
        if asking:
            raise ValueError(f"data.sources {asking} ask for regenerate: true while regenerate.enabled is false")
        return self

    def regenerates(self, source: SourceConfig) -> bool:
        """Whether the target re-answers this source's conversations."""
        return self.regenerate.enabled and source.regenerate is not False


def register_draft_section(section: type[DraftConfig]) -> None:
    """Make ``section`` (a kind's ``config_class``) a recipe's possible draft section; a kind name taken by another
    section is refused."""
    if section in DRAFT_SECTIONS:
        return
    kind = section.model_fields["kind"].default
    if kind in DRAFT_KINDS:
        raise DrafttrainError(f"draft kind {kind!r} already has a recipe section")
    DRAFT_SECTIONS.append(section)
    DRAFT_KINDS.append(kind)
    _rebuild_recipe()


def unregister_draft_section(section: type[DraftConfig]) -> None:
    """Take ``section`` out of the recipe schema again (a kind defined for a while only, as a test's toy)."""
    if section in DRAFT_SECTIONS:
        DRAFT_KINDS.remove(section.model_fields["kind"].default)
        DRAFT_SECTIONS.remove(section)
        _rebuild_recipe()


def _rebuild_recipe() -> None:
    Recipe.model_fields["draft"].annotation = _draft_section() | None
    Recipe.model_rebuild(force=True)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; the value is parsed as YAML (so 3, true, [1,2] keep their types)."""
    for item in overrides:
        if "=" not in item:
            raise DrafttrainError(f"override {item!r} is not of the form key.sub=value")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise DrafttrainError(f"override {dotted!r}: {key!r} is not a section")
            node = child
        try:
            node[keys[-1]] = yaml.safe_load(text)
        except yaml.YAMLError as err:
            problem = str(err).splitlines()[0]
            raise DrafttrainError(f"override {item!r}: the value is not valid YAML ({problem})") from None
    return raw


def describe_errors(err: ValidationError, name_of: Callable[[tuple], str]) -> str:
    """One line per error, the field named as its caller knows it (``name_of(loc)``: a recipe's dotted path, a
    CLI flag); a setting's own message continues that name ("--depth (k) must be positive")."""
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc[:1] == ["draft"] and len(loc) > 1 and loc[1] in DRAFT_KINDS:
            del loc[1]  # pydantic names the union member (the kind) in the path; the recipe has no such key
        where = name_of(tuple(loc))
        msg = "unknown key (not in the schema)" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            msg = f"draft.kind must be one of {', '.join(DRAFT_KINDS)}"
        if e["type"] == SETTING_ERROR and msg.startswith(("(", "must ")):
            lines.append(f"{where} {msg}")
        elif e["type"] == SETTING_ERROR and not where:  # a rule across settings says what it is about
            lines.append(msg)
        else:
            lines.append(f"{where or '(top level)'}: {msg}")
    return "\n".join(lines)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = describe_errors(err, lambda loc: ".".join(str(p) for p in loc)).splitlines()
    return "\n".join([f"invalid recipe {source}:", *(f"  {line}" for line in lines)])


def parse_recipe(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise DrafttrainError(format_validation_error(err, source)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise DrafttrainError(f"recipe not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise DrafttrainError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise DrafttrainError(f"recipe {path} must be a mapping at the top level")
    raw = apply_overrides(raw, overrides or [])
    recipe = parse_recipe(raw, str(path))
    check_installed([(f"{field} in {path}", module) for field, module in needed_packages(recipe)])
    return recipe

