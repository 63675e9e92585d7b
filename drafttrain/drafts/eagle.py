"""EAGLE-1/2 head: fc over [token embedding, last target hidden] (2H -> H), decoder layer(s), and the target's
own (frozen) lm_head. Trained by feature regression (smooth-L1) plus cross-entropy against the target's
next-token distribution, with uniform input noise (as in EAGLE-1). EAGLE-2 differs only at inference (dynamic
draft trees), which the proposer provides. Layout as SafeAILab/EAGLE and vLLM expect: ``fc``, ``layers.{i}.*``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from drafttrain.config import EagleConfig
from drafttrain.drafts import losses
from drafttrain.drafts.base import StepOutput, saved_section, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import (
    DraftDecoderLayer,
    llama_config_like,
    shift_left,
)
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs


class EagleDrafter(EagleHead):
    kind = "eagle"
    description = "an EAGLE-1/2 head on the target's last hidden state"
    config_class = EagleConfig

    def __init__(self, config: EagleConfig, layer_config, num_target_layers: int):
        super().__init__(config)
        self.layer_config = layer_config
        self.layer_ids = [num_target_layers]  # the final, normed hidden state that feeds the lm_head
        h = layer_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        # EAGLE-1's first layer has no input norm: the fused feature goes straight into attention.
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(layer_config, fuse_embedding=False, input_norm=i > 0) for i in range(config.num_layers)}
        )
        self.rotary = LlamaRotaryEmbedding(layer_config)

    @classmethod
    def build(cls, config: EagleConfig, target: Target, run=None) -> "EagleDrafter":
        layer_config = llama_config_like(target.config, intermediate_size=config.intermediate_size)
        head = cls(config, layer_config, target.num_layers).to(target.device).attach_target(target)
        return head.init_from_target(config.init_from_target)

    def first_layer(self):
        return self.layers["0"]

    def init_fc_passthrough(self) -> None:
        h = self.layer_config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, h:] = torch.eye(h)  # input [embedding, hidden]: keep the hidden
        self.fc.bias.zero_()

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "EagleDrafter":
        config = cls.read_checked_config(directory, target, config)
        cfg = saved_section(EagleConfig, config)
        head = cls(cfg, llama_config_like(target.config, **saved_layer_fields(config)), target.num_layers)
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    @classmethod
    def target_needs(cls, config: EagleConfig, target: Target) -> TargetNeeds:
        return TargetNeeds(layers=(target.num_layers,), logits=True)

    def interchange_config(self) -> dict:
        return {"architectures": ["EagleLlamaForCausalLM"], **self.llama_fields(), "bias": True}

    # -- export (its codecs: drafttrain.drafts.formats.eagle) ------------------------------------------------

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_output_embeddings()(hidden)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return taps  # EAGLE-1 regresses the final hidden state itself; fusion with the embedding is in step()

    def _layers(self):
        return [self.layers[k] for k in sorted(self.layers, key=int)]

    def _decode(self, hidden, input_ids, position_ids, run_layer):
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        cos, sin = self.rotary(x, position_ids)
        for index, layer in enumerate(self._layers()):
            x = run_layer(index, layer, x, cos, sin)
        return x

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        h = self._decode(hidden, input_ids, position_ids, lambda i, layer, x, c, s: layer(x, None, c, s, caches[i], mask))
        return h, self.lm_head(h)

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        input_ids = batch["input_ids"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        target_hidden = outputs.hidden.to(self.fc.weight.dtype)
        noisy = target_hidden
        if self.training and self.config.noise > 0:
            noisy = target_hidden + (torch.rand_like(target_hidden) - 0.5) * self.config.noise
        # Position t: hidden_t + embedding of token t+1 -> predict hidden_{t+1} (and so token t+2).
        pred = self._decode(
            noisy, shift_left(input_ids, 1), positions,
            lambda i, layer, x, c, s: layer.forward_ttt(x, None, c, s, []),
        )
        trainable = shift_left(batch["loss_mask"], 2).float()  # token t+2 is what position t finally predicts
        reg = losses.smooth_l1(pred, shift_left(target_hidden, 1), trainable)
        logits = self.lm_head(pred)
        target_logits = shift_left(outputs.logits, 1).detach()
        ce = losses.soft_cross_entropy(logits, target_logits, trainable)
        loss = self.config.regression_weight * reg + self.config.ce_weight * ce
        with torch.no_grad():
            correct, counted = top1_hits(logits.argmax(-1), target_logits.argmax(-1), trainable)
        metrics = {"loss_reg": float(reg.detach()), "loss_ce": float(ce.detach())}
        return StepOutput(loss=loss, metrics=metrics, correct=[correct], counted=[counted])


def saved_layer_fields(config: dict) -> dict:
    """The draft layers' shape as a checkpoint's config.json records it (drafttrain's own record the target's; an
    imported head's, its own)."""
    names = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
             "hidden_act", "rope_parameters")
    return {k: config[k] for k in names if config.get(k) is not None}
