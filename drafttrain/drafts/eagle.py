"""EAGLE-1/2 head: fc over [token embedding, last target hidden] (2H -> H), decoder layer(s), and the target's
own (frozen) lm_head. Trained by feature regression (smooth-L1) plus cross-entropy against the target's
next-token distribution, with uniform input noise (as in EAGLE-1). EAGLE-2 differs only at inference (dynamic
draft trees), which the proposer provides. Layout as SafeAILab/EAGLE and vLLM expect: ``fc``, ``layers.{i}.*``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig
from drafttrain.drafts.base import DraftHead, StepOutput, TargetFeatures, shift_left, soft_cross_entropy
from drafttrain.drafts.layers import DraftDecoderLayer, LayerCache, llama_config_like
from drafttrain.drafts.registry import register_draft


class EagleConfig(DraftConfig):
    kind: Literal["eagle"] = "eagle"
    num_layers: int = Field(1, ge=1)
    regression_weight: float = Field(1.0, ge=0)
    ce_weight: float = Field(0.1, ge=0)
    noise: float = Field(0.2, ge=0)  # width of the uniform noise added to input features (EAGLE-1: 0.2)
    intermediate_size: int | None = Field(None, gt=0)


@register_draft
class EagleDraft(DraftHead):
    kind = "eagle"
    config_class = EagleConfig

    def __init__(self, draft_config: EagleConfig, layer_config, num_target_layers: int):
        super().__init__()
        self.draft_config = draft_config
        self.layer_config = layer_config
        self.layer_ids = [num_target_layers]  # the final, normed hidden state that feeds the lm_head
        h = layer_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        # EAGLE-1's first layer has no input norm: the fused feature goes straight into attention.
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(layer_config, fuse_embedding=False, input_norm=i > 0) for i in range(draft_config.num_layers)}
        )
        self.rotary = LlamaRotaryEmbedding(layer_config)

    @classmethod
    def build(cls, cfg: EagleConfig, target, output_dir=None) -> "EagleDraft":
        layer_config = llama_config_like(target.config, intermediate_size=cfg.intermediate_size)
        return cls(cfg, layer_config, target.num_layers).to(target.device).attach_target(target)

    @classmethod
    def from_pretrained(cls, directory, target) -> "EagleDraft":
        from drafttrain.drafts.base import read_draft_config

        config = read_draft_config(directory)
        if config["vocab_size"] != target.vocab_size or config["hidden_size"] != target.hidden_size:
            raise DrafttrainError(
                f"draft at {directory} was trained for a target with vocab {config['vocab_size']} and hidden "
                f"{config['hidden_size']}; this target has {target.vocab_size} and {target.hidden_size}"
            )
        cfg = EagleConfig.model_validate(config["drafttrain"]["draft"])
        head = cls(cfg, llama_config_like(target.config, intermediate_size=config["intermediate_size"]), target.num_layers)
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    def interchange_config(self) -> dict:
        return {"architectures": ["EagleLlamaForCausalLM"], **self.llama_fields(), "bias": True}

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_output_embeddings()(hidden)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return taps  # EAGLE-1 regresses the final hidden state itself; fusion with the embedding is in step()

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in range(self.draft_config.num_layers)]

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

    def training_step(self, batch: dict[str, torch.Tensor], features: TargetFeatures) -> StepOutput:
        input_ids = batch["input_ids"]
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        target_hidden = features.hidden.to(self.fc.weight.dtype)
        noisy = target_hidden
        if self.training and self.draft_config.noise > 0:
            noisy = target_hidden + (torch.rand_like(target_hidden) - 0.5) * self.draft_config.noise
        # Position t: hidden_t + embedding of token t+1 -> predict hidden_{t+1} (and so token t+2).
        pred = self._decode(
            noisy, shift_left(input_ids, 1), positions,
            lambda i, layer, x, c, s: layer.forward_ttt(x, None, c, s, []),
        )
        trainable = shift_left(batch["loss_mask"], 2).to(pred.dtype)
        want_hidden = shift_left(target_hidden, 1)
        reg = F.smooth_l1_loss(pred, want_hidden, reduction="none").mean(-1)
        reg = (reg * trainable).sum() / trainable.sum().clamp(min=1)
        logits = self.lm_head(pred)
        with torch.no_grad():
            target_logits = shift_left(features.logits, 1)
            target_p = torch.softmax(target_logits.float(), dim=-1)
        ce = soft_cross_entropy(logits, target_p, trainable)
        loss = self.draft_config.regression_weight * reg + self.draft_config.ce_weight * ce
        with torch.no_grad():
            hit = (logits.argmax(-1) == target_logits.argmax(-1)).to(trainable.dtype)
            acc = float((hit * trainable).sum() / trainable.sum().clamp(min=1))
        metrics = {"loss_reg": float(reg.detach()), "loss_ce": float(ce.detach()), "acc_0": acc}
        return StepOutput(loss=loss, metrics=metrics, step_accuracies=[acc])
