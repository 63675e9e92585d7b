"""EAGLE-3 head: fused low/mid/high target features, one (or more) decoder layers, a reduced draft vocabulary,
trained with training-time test (the draft's own outputs fed back for k unrolled steps).

Parameter names follow the EAGLE-3 interchange layout that vLLM and SGLang load: ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d`` (extra layers, if any, as ``layers.{i}.*``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from drafttrain.config import Eagle3Config
from drafttrain.data.vocab import draft_ids, draft_vocab_for, target_to_draft, to_target_vocab
from drafttrain.drafts import losses
from drafttrain.drafts.base import StepOutput, saved_section, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import (
    DraftDecoderLayer,
    llama_config_like,
    shift_left,
)
from drafttrain.drafts.taps import check_taps, low_mid_high_taps
from drafttrain.runfolder import RunFolder
from drafttrain.targets import Target
from drafttrain.targets.hidden import final_norm_scale
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, rows_and_argmax


class Eagle3Drafter(EagleHead):
    kind = "eagle3"
    description = "an EAGLE-3 head on three of the target's hidden layers"
    config_class = Eagle3Config
    adopts_vocabulary = True

    def __init__(self, config: Eagle3Config, layer_config, layer_ids: list[int], d2t, t2d):
        super().__init__(config)
        self.layer_config = layer_config
        self.layer_ids = list(layer_ids)
        h = layer_config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        if config.fc_norm:  # EAGLE-3.1: one norm per tap before fc (vLLM's and speculators' fc_norm.{i})
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(h, eps=layer_config.rms_norm_eps) for _ in layer_ids)
        self.midlayer = DraftDecoderLayer(layer_config, fuse_embedding=True)
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(layer_config, fuse_embedding=False) for i in range(1, config.num_layers)}
        )
        self.norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, d2t.numel(), bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.rotary = LlamaRotaryEmbedding(layer_config)  # buffers only, not persistent

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def aux_layers(cls, config: Eagle3Config, num_layers: int) -> list[int]:
        return check_taps(config.layers or low_mid_high_taps(num_layers), num_layers)

    @classmethod
    def target_needs(cls, config: Eagle3Config, target: Target) -> TargetNeeds:
        return TargetNeeds(layers=tuple(cls.aux_layers(config, target.num_layers)), logits=True)

    def needs(self) -> TargetNeeds:
        """Only the draft vocabulary's logits (and the full argmax, for the in-vocabulary mask) reach the loss."""
        return dataclasses.replace(super().needs(), logits_rows=self.draft_to_target)

    @classmethod
    def build(cls, config: Eagle3Config, target: Target, run: RunFolder | None = None) -> "Eagle3Drafter":
        layer_ids = cls.aux_layers(config, target.num_layers)
        d2t, t2d = draft_vocab_for(config.draft_vocab, run, target.vocab_size)
        layer_config = llama_config_like(target.config, intermediate_size=config.intermediate_size,
                                         sliding_window=config.sliding_window)
        head = cls(config, layer_config, layer_ids, d2t, t2d, **cls.built_extras(config, target))
        head = head.to(target.device).attach_target(target)
        return head.init_from_target(config.init_from_target)

    @classmethod
    def built_extras(cls, config: Eagle3Config, target: Target) -> dict:
        """What a variant's constructor takes beside the head's own arguments, for a fresh draft."""
        return {}

    @classmethod
    def saved_extras(cls, config: dict) -> dict:
        """What a variant's constructor takes beside the head's own arguments, read from a saved config."""
        return {}

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "Eagle3Drafter":
        super().init_from_target(parts)
        if "lm_head" in parts:  # the target's own output rows for the draft vocabulary, behind its final norm
            self.lm_head.weight.copy_(self.target.model.get_output_embeddings().weight[self.draft_to_target])
            self.norm.weight.copy_(final_norm_scale(self.target.model))
        return self

    def adopt_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """The output rows of the tokens both vocabularies hold carry over as trained; the new tokens' rows start
        as the target's own (what init_from_target gives a fresh head)."""
        new_ids = draft_ids(d2t.to(self.d2t.device))
        old_rows = target_to_draft(new_ids, self.t2d)
        kept = old_rows >= 0
        weight = self.lm_head.weight
        self.lm_head = nn.Linear(weight.shape[1], new_ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target.model.get_output_embeddings().weight[new_ids])
            self.lm_head.weight[kept] = weight[old_rows[kept]]
        self.d2t, self.t2d = d2t.to(self.d2t.device).clone(), t2d.to(self.t2d.device).clone()

    def first_layer(self):
        return self.midlayer

    def init_fc_passthrough(self) -> None:
        h = self.layer_config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h)

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "Eagle3Drafter":
        config = cls.read_checked_config(directory, target, config)
        cfg = saved_section(Eagle3Config, config)
        layer_ids = check_taps(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], target.num_layers)
        n = config["draft_vocab_size"]
        layer_config = llama_config_like(target.config, intermediate_size=config["intermediate_size"],
                                         sliding_window=cfg.sliding_window)
        head = cls(cfg, layer_config, layer_ids, torch.zeros(n, dtype=torch.long),
                   torch.zeros(target.vocab_size, dtype=torch.bool), **cls.saved_extras(config))
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    def interchange_config(self) -> dict:
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **self.llama_fields(),
            "target_hidden_size": self.layer_config.hidden_size,
            "draft_vocab_size": int(self.d2t.numel()),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids, "use_aux_hidden_state": True},
        }
        return {**config, **self.interchange_extras(), **self.reader_options()}

    def interchange_extras(self) -> dict:
        """What a variant's interchange config adds after the EAGLE-3 fields."""
        return {}

    # -- export (its codecs: drafttrain.drafts.formats.eagle3) ------------------------------------------------
    def reader_options(self) -> dict:
        """EAGLE-3.1's flags and the sliding window, under the names vLLM and speculators read (a window as vLLM's
        Llama layers read it: per-layer types and one size); left out when off (the readers' default)."""
        fields = {name: True for name in ("fc_norm", "norm_output") if getattr(self.config, name)}
        if self.config.sliding_window is not None:
            fields.update(sliding_window=self.config.sliding_window, use_sliding_window=True,
                          layer_types=["sliding_attention"] * self.config.num_layers)
        return fields

    # -- shared forward pieces ---------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        if self.config.fc_norm:
            taps = torch.cat([norm(tap) for norm, tap in zip(self.fc_norm, taps.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(taps)

    def head_out(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft-vocabulary logits of a layer output, and the hidden the next step reads: the output itself, or
        with EAGLE-3.1's norm_output its final-normed form (the one the logits are computed from)."""
        normed = self.norm(h)
        return (normed if self.config.norm_output else h), self.lm_head(normed)

    def _extra_layers(self):
        return [self.layers[k] for k in sorted(self.layers, key=int)]

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        cos, sin = self.rotary(hidden, position_ids)
        positions = position_ids[0]  # where each new entry sits: a sliding window reads it
        h = self.midlayer(hidden, self.embed(input_ids), cos, sin, caches[0], mask, positions)
        for layer, cache in zip(self._extra_layers(), caches[1:]):
            h = layer(h, None, cos, sin, cache, mask, positions)
        h, logits = self.head_out(h)
        return h, self.target_logits(logits)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return to_target_vocab(draft_logits, self.d2t, self.t2d)

    # -- training ------------------------------------------------------------------------------------------
    def _trained_positions(self, target_ids: torch.Tensor) -> torch.Tensor:
        """1.0 where the loss reads a position by its target argmax: in the draft vocabulary (a token outside it
        can never be accepted), or everywhere with ``train_out_of_vocab``."""
        if self.config.train_out_of_vocab:
            return torch.ones(target_ids.shape, dtype=torch.float32, device=target_ids.device)
        return self.t2d[target_ids].float()

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        with torch.no_grad():  # the target's logits over the draft vocabulary, its argmax over all of it
            target_ids, target_logits = rows_and_argmax(outputs, self.draft_to_target)
            by_argmax = self._trained_positions(target_ids)
        taps = outputs.hidden.to(self.fc.weight.dtype)
        if self.training and self.config.noise > 0:
            taps = taps + (torch.rand_like(taps) - 0.5) * self.config.noise
        hidden = self.fuse(taps)
        blocks = [[] for _ in range(self.config.num_layers)]
        total, metrics, correct, counted = 0.0, {}, [], []
        for i in range(self.config.ttt_steps):
            # Step i at position t: hidden for t (real at i=0, the draft's own after), embedding of the true
            # token t+1+i; it predicts token t+2+i, whose target distribution sits at position t+1+i.
            trainable = shift_left(loss_mask, 2 + i)
            cos, sin = self.rotary(hidden, positions + i)
            h = self.midlayer.forward_ttt(hidden, self.embed(shift_left(input_ids, 1 + i)), cos, sin, blocks[0])
            for layer, layer_blocks in zip(self._extra_layers(), blocks[1:]):
                h = layer.forward_ttt(h, None, cos, sin, layer_blocks)
            h, logits = self.head_out(h)
            loss_i = losses.soft_cross_entropy(logits, shift_left(target_logits, 1 + i),
                                               trainable * shift_left(by_argmax, 1 + i))
            total = total + self.config.step_decay**i * loss_i
            with torch.no_grad():
                hits, n = top1_hits(self.draft_to_target[logits.argmax(-1)], shift_left(target_ids, 1 + i), trainable)
            correct.append(hits)
            counted.append(n)
            metrics[f"loss_{i}"] = float(loss_i.detach())
            hidden = h
        return StepOutput(loss=total, metrics=metrics, correct=correct, counted=counted)
