"""Distilled draft models: a small causal LM trained so that its next-token distribution agrees with the target's
(DistillSpec), served by the ``draft_model`` proposer and saved as a plain HF model folder any engine can load.

The student is a named model sharing the target's tokenizer, or one cut from the target: chosen decoder layers
(``every:N``, ``first:K`` or a list) with the target's embeddings, norm and lm_head, starting from its weights.
Full-weight training by default, LoRA adapters (peft) as an option (merged into the saved folder).

Loss: a divergence from drafttrain.drafts.losses between the target's distribution p and the draft's q at every
trainable position, at a temperature: fkl, rkl, jsd (β as in TRL's GKD), tvd; or sft, cross-entropy on the data's
tokens. The target's distribution comes online, or from an offline teacher cache as its top-k (the divergence is
then taken over the k tokens and one bucket for the rest). Options:

* on-policy data (DistillSpec / GKD's λ): a share of batches is answered by the current draft, sampled in one
  batched ``generate``, and scored by the target; the time it costs is logged (``on_policy_s``);
* AdaSPEC-style selective distillation: each batch's hardest tokens for the draft are left out;
* ``loss_vocab: draft``: the loss over the draft vocabulary's rows alone (EAGLE-3's rule: both distributions
  renormalised over them, positions whose target argmax is outside left out). With a large vocabulary and a small
  student, the lm_head and the divergence are most of a training step; the draft_model proposer drafts from those
  rows anyway. On-policy answers are then sampled from them too.

Logged per step: the exact per-token acceptance under speculative sampling at T=1, 1 - TVD(p, q) (``acceptance``),
and the top-1 agreement with the target (what greedy drafting is paid for).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LogitsProcessorList

from drafttrain import DrafttrainError
from drafttrain.config import DraftModelConfig
from drafttrain.data.chat import stop_token_ids
from drafttrain.data.vocab import draft_ids, draft_vocab_for, read_vocab_mapping, target_to_draft
from drafttrain.drafts import losses
from drafttrain.drafts.base import Drafter, StepOutput, saved_section, top1_hits, with_lora
from drafttrain.drafts.layers import shift_left
from drafttrain.runfolder import CONFIG_NAME, RunFolder, read_json
from drafttrain.targets import Target, check_same_tokenizer, load_target
from drafttrain.targets.hidden import decoder, decoder_layers
from drafttrain.targets.outputs import (
    TargetNeeds,
    TargetOutputs,
    head_logits,
    plain_lm_head,
    rows_and_argmax,
    run_target,
)

log = logging.getLogger(__name__)

# d2t / t2d of the vocabulary the draft_model proposer drafts from; in a subfolder, since engines (vLLM) load every
# top-level *.safetensors file of a model folder as weights
SERVING_VOCAB = "draft_vocab/draft_vocab.safetensors"


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    description = "a small causal LM distilled to agree with the target"
    config_class = DraftModelConfig
    proposer = "draft_model"
    # a whole LM of its own: any target with its tokenizer serves (the same draft model for a family's sizes)
    target_facts = ()

    def __init__(self, config: DraftModelConfig, student: torch.nn.Module,
                 vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(config)
        self.student = student
        self.vocab = vocab  # (d2t, t2d) of the draft vocabulary it is served with, or None: the whole vocabulary
        self._on_policy_s: float | None = None  # the last on-policy batch's sampling time, for the step's metrics

    @property
    def serving_vocab(self) -> torch.Tensor | None:
        """The target ids the draft_model proposer computes logits for (None: all)."""
        return None if self.vocab is None else draft_ids(self.vocab[0])

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def target_needs(cls, config: DraftModelConfig, target: Target) -> TargetNeeds:
        if config.divergence == "sft":
            return TargetNeeds()  # the data's tokens alone
        # a loss over the draft vocabulary needs the target's logits at its rows: a teacher cache keeps the final
        # hidden state to recompute them, not a top-k that may fall outside them
        top_k = None if config.loss_vocab == "draft" else config.teacher_top_k
        return TargetNeeds(logits=True, logits_top_k=top_k, logits_temperature=config.temperature)

    @classmethod
    def build(cls, config: DraftModelConfig, target: Target, run: RunFolder | None = None) -> "DraftModelDrafter":
        if config.cut is not None:
            student = cut_from_target(target, config.cut)
        else:
            named = load_target(config.student, dtype=str(target.model.dtype).removeprefix("torch."),
                                device=str(target.device), role="draft model (draft.student)")
            if target.tokenizer is not None:
                check_same_tokenizer(target, named)
            student = named.model
        warn_if_larger(student, target)
        student.requires_grad_(True)
        if config.draft_lora is not None:
            student = with_lora(student, config.draft_lora, "the draft model", "draft.draft_lora")
        d2t, t2d = draft_vocab_for(config.draft_vocab, run, target.vocab_size)
        vocab = (d2t, t2d) if d2t.numel() < t2d.numel() else None
        if config.loss_vocab == "draft":
            if vocab is None:
                raise DrafttrainError("draft.loss_vocab: draft needs a draft vocabulary: enable draft_vocab in the "
                                      "recipe (prepare builds it) or give draft.draft_vocab")
            plain_lm_head(student, draft_ids(d2t))
        return cls(config, student.train(), vocab, **cls.built_extras(config, target)).attach_target(target)

    @classmethod
    def built_extras(cls, config: DraftModelConfig, target: Target) -> dict:
        """What a variant's constructor takes beside the student and its vocabulary, for a fresh draft."""
        return {}

    @classmethod
    def saved_extras(cls, config: dict) -> dict:
        """What a variant's constructor takes beside the student and its vocabulary, read from a saved config."""
        return {}

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "DraftModelDrafter":
        directory = Path(directory)
        saved = config or read_json(directory / CONFIG_NAME)
        config = saved_section(DraftModelConfig, saved)
        student = AutoModelForCausalLM.from_pretrained(str(directory), dtype=target.model.dtype, use_safetensors=True)
        vocab_file = directory / SERVING_VOCAB
        vocab = read_vocab_mapping(vocab_file, target.vocab_size) if vocab_file.is_file() else None
        extras = cls.saved_extras(saved)
        return cls(config, student.to(target.device).eval(), vocab, **extras).attach_target(target)

    def save_pretrained(self, directory, **meta) -> Path:
        """A plain HF model folder (weights, config, the target's tokenizer) with a ``drafttrain`` section in its
        config: what vLLM, SGLang or HF assisted generation take as a draft model."""
        directory = Path(directory)
        model = _merged_copy(self.student) if self.config.draft_lora is not None else self.student
        model.save_pretrained(str(directory), safe_serialization=True)
        tokenizer = self.target.tokenizer
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        config = {**json.loads((directory / CONFIG_NAME).read_text()), **self.checkpoint_config(**meta)}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        if self.vocab is not None:  # beside the model, which other engines load whole
            (directory / SERVING_VOCAB).parent.mkdir(exist_ok=True)
            save_file({"d2t": self.vocab[0].cpu(), "t2d": self.vocab[1].cpu()}, str(directory / SERVING_VOCAB))
        return directory

    def interchange_config(self) -> dict:
        """The student's own HF config is the interchange config (save_pretrained writes it)."""
        return {}

    # -- training ------------------------------------------------------------------------------------------
    @property
    def loss_rows(self) -> torch.Tensor | None:
        """The target ids the loss is taken over (``loss_vocab: draft``), or None: the whole vocabulary."""
        return self.serving_vocab if self.config.loss_vocab == "draft" else None

    def needs(self) -> TargetNeeds:
        return self._at_loss_rows(super().needs())

    def held_out_needs(self) -> TargetNeeds:
        """The target's logits even for SFT, so that β is measured on held-out rows whatever the divergence."""
        needs = self.needs()
        return needs if needs.logits else self._at_loss_rows(TargetNeeds(logits=True))

    def _at_loss_rows(self, needs: TargetNeeds) -> TargetNeeds:
        if self.loss_rows is not None and needs.logits:  # the target's logits at those rows, its argmax over all
            needs = dataclasses.replace(needs, logits_rows=self.loss_rows.to(self.target.device))
        return needs

    def student_logits(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None,
                       at: torch.Tensor) -> torch.Tensor:
        """The student's logits [N, V] at the N positions ``at`` (a [B, T] mask) alone, over the target's vocabulary
        or over ``rows`` (its lm_head's rows for them: the other rows are never computed). The lm_head and the
        divergence cost more than a small student's decoder, and about half of a batch's positions are prompt or
        padding, which no loss reads."""
        inputs = dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        hidden = decoder(self.student)(**inputs).last_hidden_state[at]
        if rows is None:
            return self.aligned(head_logits(self.student, hidden[None])[0])
        # build checked the lm_head is plain
        return torch.nn.functional.linear(hidden, self.student.get_output_embeddings().weight[rows])

    def own_step_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict, TargetOutputs] | None:
        """With probability ``on_policy`` while training: the batch's prompts answered by the draft itself, and
        the target's logits for them, computed online (a teacher cache holds none for these rows)."""
        cfg = self.config
        if not (cfg.on_policy > 0 and self.training and float(torch.rand(())) < cfg.on_policy):
            return None
        started = time.perf_counter()
        batch = self.on_policy_batch(batch)
        self._on_policy_s = time.perf_counter() - started
        with torch.no_grad():
            return batch, run_target(self.target, batch, self.needs())

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        cfg, metrics, rows = self.config, {}, self.loss_rows
        rows = None if rows is None else rows.to(batch["input_ids"].device)
        if self._on_policy_s is not None:  # this step's rows are the draft's own answers (own_step_inputs)
            metrics["on_policy_s"], self._on_policy_s = self._on_policy_s, None
        logits, scored_at, depths = self.scored_logits(batch, rows, outputs)
        weight = _at(shift_left(batch["loss_mask"].float(), 1), scored_at)  # position t predicts token t+1
        labels = _at(shift_left(batch["input_ids"], 1), scored_at)
        teacher_top1 = teacher = None
        if outputs.logits is not None and outputs.top_k is None:  # SFT is given them on held-out rows, for beta
            teacher_top1, teacher = (_at(x, scored_at) for x in self._teacher(outputs, rows))
        if cfg.divergence == "sft":
            targets = labels
            teacher_top1 = labels if teacher_top1 is None else teacher_top1
            if rows is not None:  # tokens outside the rows are not trained
                targets = target_to_draft(labels, self.vocab[1])
                weight = weight * (targets >= 0)
            per = -losses.log_probs(logits, cfg.temperature).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        elif outputs.top_k is not None:
            top_k_ids = _at(outputs.top_k.ids, scored_at)
            per = losses.per_position(cfg.divergence, losses.top_k_buckets(logits, top_k_ids, cfg.temperature),
                                      _at(outputs.top_k.buckets, scored_at), cfg.beta)
            teacher_top1 = top_k_ids[..., 0]
        else:
            if rows is not None:  # where the target's own choice is one of the rows (as EAGLE-3)
                weight = weight * self.vocab[1].to(teacher_top1.device)[teacher_top1]
            log_q, log_p = losses.log_probs(logits, cfg.temperature), losses.log_probs(teacher, cfg.temperature)
            per = losses.per_position(cfg.divergence, log_q, log_p, cfg.beta)
        measures = {}
        if teacher is not None:
            with torch.no_grad():  # what speculative sampling at T=1 accepts per token: beta = 1 - TVD(p, q)
                if cfg.temperature != 1 or cfg.divergence == "sft":  # else the loss's log-probabilities are these
                    log_q, log_p = losses.log_probs(logits), losses.log_probs(teacher)
                beta = 1 - losses.per_position("tvd", log_q.detach(), log_p)
                measures["beta"] = (float((beta * weight).sum()), float(weight.sum()))
                metrics["acceptance"] = measures["beta"][0] / max(measures["beta"][1], 1e-9)
        if cfg.token_filter > 0:
            weight = weight * keep_learnable(per.detach(), weight, cfg.token_filter)
        loss = losses.masked_mean(per, weight)
        with torch.no_grad():
            drafted = logits.argmax(-1)
            drafted = drafted if rows is None else rows[drafted]
            hits = [top1_hits(drafted, teacher_top1, weight if depths is None else weight * (depths == d))
                    for d in range(self.max_draft_depth(cfg) or 1)]  # per draft position
        metrics["loss_" + cfg.divergence] = float(loss.detach())
        return StepOutput(loss=loss, metrics=metrics, correct=[c for c, _ in hits], counted=[n for _, n in hits],
                          measures=measures)

    def scored_logits(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None, outputs: TargetOutputs) \
            -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The student's logits at the positions the loss reads (the trained ones, flattened to [N, ...]), where
        they are (a [B, T] mask) and each one's draft depth (None: all the first)."""
        scored_at = shift_left(batch["loss_mask"], 1) > 0
        return self.student_logits(batch, rows, scored_at), scored_at, None

    @staticmethod
    def _teacher(outputs: TargetOutputs, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's top-1 over its whole vocabulary, its logits over the loss's vocabulary)."""
        if rows is None:
            teacher = outputs.logits.detach()
            return teacher.argmax(-1), teacher
        return rows_and_argmax(outputs, rows)

    def aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """The student's logits over the target's vocabulary size (same tokenizer, differently padded heads)."""
        v, target_v = logits.shape[-1], self.target.vocab_size
        if v > target_v:
            return logits[..., :target_v]
        if v < target_v:
            return torch.nn.functional.pad(logits, (0, target_v - v), value=float("-inf"))
        return logits

    def _within_loss_rows(self):
        rows = self.loss_rows  # the rows outside are untrained: sampling them would teach nothing it is served with
        return LogitsProcessorList([_OnlyRows(rows)] if rows is not None else [])

    @torch.no_grad()
    def on_policy_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's prompts (each row up to its first trained token) answered by the current draft, sampled in
        one batched generate; the answers are the trained tokens."""
        cfg, device = self.config, batch["input_ids"].device
        prompts = []
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            trained = mask.nonzero()
            start = int(trained[0]) if len(trained) else int(batch["attention_mask"].sum())
            prompts.append(ids[: max(start, 1)])
        stops = stop_token_ids(self.target.tokenizer, self.target.model.generation_config)
        width = max(len(p) for p in prompts)
        pad = stops[0]
        left = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
        attention = torch.zeros_like(left)
        for i, p in enumerate(prompts):
            left[i, width - len(p):], attention[i, width - len(p):] = p, 1
        was_training = self.student.training
        self.student.eval()
        try:
            generated = self.student.generate(
                input_ids=left, attention_mask=attention, max_new_tokens=cfg.on_policy_max_new_tokens,
                do_sample=cfg.on_policy_temperature > 0, temperature=cfg.on_policy_temperature or None, top_p=None,
                top_k=None, eos_token_id=stops, pad_token_id=pad, logits_processor=self._within_loss_rows())[:, width:]
        finally:
            self.student.train(was_training)
        rows = []
        for p, answer in zip(prompts, generated.tolist()):
            end = next((i + 1 for i, t in enumerate(answer) if t in stops), len(answer))
            rows.append((p.tolist(), answer[:end]))
        longest = max(len(p) + len(a) for p, a in rows)
        out = {k: torch.zeros(len(rows), longest, dtype=torch.long, device=device)
               for k in ("input_ids", "loss_mask", "attention_mask")}
        out["input_ids"].fill_(pad)
        for i, (p, a) in enumerate(rows):
            out["input_ids"][i, : len(p) + len(a)] = torch.tensor(p + a, device=device)
            out["attention_mask"][i, : len(p) + len(a)] = 1
            out["loss_mask"][i, len(p): len(p) + len(a)] = 1
        return out


class _OnlyRows:
    """A generate logits processor: tokens outside ``rows`` get -inf (the student drafts from its loss rows)."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.outside = rows, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.outside is None:  # once per generate: every step has the same vocabulary and device
            self.outside = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
            self.outside[self.rows.to(scores.device)] = False
        return scores.masked_fill(self.outside, float("-inf"))


def keep_learnable(per_token: torch.Tensor, weight: torch.Tensor, share: float) -> torch.Tensor:
    """1 for the tokens kept, 0 for the ``share`` of the weighted tokens with the largest divergence."""
    trained = weight > 0
    count = int(trained.sum())
    drop = int(share * count)
    if drop == 0:
        return torch.ones_like(weight)
    threshold = per_token[trained].topk(drop).values[-1]
    return torch.where(trained, (per_token < threshold).float(), torch.ones_like(weight))


# ------------------------------------------------------------------------------------------------ students


def cut_from_target(target: Target, cut: str | list[int]) -> torch.nn.Module:
    """A copy of the target that keeps only the chosen decoder layers (and its embeddings, final norm and lm_head),
    with the target's weights: its forward is the target's computation through those layers."""
    model = target.model
    total = target.num_layers
    if isinstance(cut, str):
        how, n = cut.split(":")
        keep = list(range(0, total, int(n))) if how == "every" else list(range(min(int(n), total)))
    else:
        keep = list(cut)
    if not keep or keep[-1] >= total:
        raise DrafttrainError(f"draft.cut {cut!r}: the target has layers 0..{total - 1}")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = len(keep)
    for name in ("layer_types",):  # per-layer settings (sliding windows ...) follow their layers
        values = getattr(config, name, None)
        if isinstance(values, list) and len(values) == total:
            setattr(config, name, [values[i] for i in keep])
    student = type(model)(config).to(dtype=model.dtype, device=target.device)
    prefix = next(name for name, module in model.named_modules() if module is decoder_layers(model)) + "."
    source = model.state_dict()
    state = {}
    for key in student.state_dict():
        if key.startswith(prefix):
            index, rest = key[len(prefix):].split(".", 1)
            state[key] = source[f"{prefix}{keep[int(index)]}.{rest}"]
        else:
            state[key] = source[key]
    student.load_state_dict(state)
    student.generation_config = model.generation_config
    return student


def warn_if_larger(student: torch.nn.Module, target: Target) -> None:
    ours, theirs = sum(p.numel() for p in student.parameters()), sum(p.numel() for p in target.model.parameters())
    if ours >= theirs:
        log.warning("the draft model has %s parameters, the target %s: a draft as large as its target cannot make "
                    "decoding faster", f"{ours:,}", f"{theirs:,}")


def _merged_copy(peft_model: torch.nn.Module) -> torch.nn.Module:
    """The student with its adapters merged, leaving the training model untouched."""
    return copy.deepcopy(peft_model).merge_and_unload()


def _at(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values`` (B, T, ...) at each slot's position (B, N) (PARD's layout; -1: a padding slot, given zeros), or at
    the positions a (B, T) boolean mask sets, flattened to (N, ...)."""
    if positions.dtype == torch.bool:
        return values[positions]
    index = positions.clamp(min=0)
    picked = values.gather(1, index.view(*index.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:]))
    keep = (positions >= 0).view(*positions.shape, *([1] * (values.dim() - 2)))
    return picked * keep if picked.is_floating_point() else torch.where(keep, picked, torch.zeros_like(picked))
