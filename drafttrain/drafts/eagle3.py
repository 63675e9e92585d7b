"""EAGLE-3 head: fused low/mid/high target features, one (or more) decoder layers, a reduced draft vocabulary,
trained with training-time test (the draft's own outputs fed back for k unrolled steps).

Parameter names follow the EAGLE-3 interchange layout that vLLM and SGLang load: ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d`` (extra layers, if any, as ``layers.{i}.*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from safetensors.torch import load_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig
from drafttrain.drafts.base import DraftHead, StepOutput, TargetFeatures, shift_left, soft_cross_entropy
from drafttrain.drafts.layers import DraftDecoderLayer, LayerCache, llama_config_like
from drafttrain.drafts.registry import register_draft
from drafttrain.targets.hidden import eagle3_default_layers, resolve_layers

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class Eagle3Config(DraftConfig):
    kind: Literal["eagle3"] = "eagle3"
    num_layers: int = Field(1, ge=1)
    # Target taps in HF hidden_states numbering (i = input of layer i); default: inputs of 2, L/2, L-3.
    layers: list[int] | None = Field(None, min_length=1)
    # d2t/t2d mapping from `drafttrain prepare`; default <output_dir>/draft_vocab.safetensors when it exists,
    # else the full target vocabulary.
    draft_vocab: str | None = None
    ttt_steps: int = Field(7, ge=1)
    step_decay: float = Field(0.8, gt=0, le=1)  # loss weight of unrolled step i is step_decay**i
    intermediate_size: int | None = Field(None, gt=0)


def load_vocab_mapping(path: Path, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001
        raise DrafttrainError(f"cannot read draft vocab {path}: {err}") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DrafttrainError(f"draft vocab {path} lacks d2t/t2d tensors")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    if t2d.numel() != target_vocab:
        raise DrafttrainError(
            f"draft vocab {path} was built for a vocabulary of {t2d.numel()} tokens, the target has {target_vocab}"
        )
    if d2t.numel() > target_vocab:
        raise DrafttrainError(f"draft vocab size {d2t.numel()} is larger than the target's {target_vocab}")
    return d2t, t2d


@register_draft
class Eagle3Draft(DraftHead):
    kind = "eagle3"
    config_class = Eagle3Config

    def __init__(self, draft_config: Eagle3Config, layer_config, layer_ids: list[int], d2t, t2d):
        super().__init__()
        self.draft_config = draft_config
        self.layer_config = layer_config
        self.layer_ids = list(layer_ids)
        h = layer_config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = DraftDecoderLayer(layer_config, fuse_embedding=True)
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(layer_config, fuse_embedding=False) for i in range(1, draft_config.num_layers)}
        )
        self.norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, d2t.numel(), bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.rotary = LlamaRotaryEmbedding(layer_config)  # buffers only, not persistent

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: Eagle3Config, target, output_dir: str | Path | None = None) -> "Eagle3Draft":
        num_layers = target.num_layers
        layer_ids = resolve_layers(cfg.layers or eagle3_default_layers(num_layers), num_layers)
        vocab_path = Path(cfg.draft_vocab) if cfg.draft_vocab else None
        if vocab_path is None and output_dir is not None and (Path(output_dir) / DRAFT_VOCAB_FILE).is_file():
            vocab_path = Path(output_dir) / DRAFT_VOCAB_FILE
        if vocab_path is not None:
            if not vocab_path.is_file():
                raise DrafttrainError(f"draft vocab file not found: {vocab_path} (run `drafttrain prepare` first)")
            d2t, t2d = load_vocab_mapping(vocab_path, target.vocab_size)
        else:  # full vocabulary: draft id == target id
            d2t = torch.zeros(target.vocab_size, dtype=torch.long)
            t2d = torch.ones(target.vocab_size, dtype=torch.bool)
        layer_config = llama_config_like(target.config, intermediate_size=cfg.intermediate_size)
        head = cls(cfg, layer_config, layer_ids, d2t, t2d).to(target.device)
        return head.attach_target(target)

    @classmethod
    def from_pretrained(cls, directory, target) -> "Eagle3Draft":
        from drafttrain.drafts.base import read_draft_config

        config = read_draft_config(directory)
        cfg = Eagle3Config.model_validate(config["drafttrain"]["draft"])
        layer_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if config["vocab_size"] != target.vocab_size or config["hidden_size"] != target.hidden_size:
            raise DrafttrainError(
                f"draft at {directory} was trained for a target with vocab {config['vocab_size']} and hidden "
                f"{config['hidden_size']}; this target has {target.vocab_size} and {target.hidden_size}"
            )
        resolve_layers(layer_ids, target.num_layers)
        n = config["draft_vocab_size"]
        layer_config = llama_config_like(target.config, intermediate_size=config["intermediate_size"])
        head = cls(cfg, layer_config, layer_ids, torch.zeros(n, dtype=torch.long), torch.zeros(target.vocab_size, dtype=torch.bool))
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    def interchange_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **self.llama_fields(),
            "target_hidden_size": self.layer_config.hidden_size,
            "draft_vocab_size": int(self.d2t.numel()),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids, "use_aux_hidden_state": True},
        }

    # -- shared forward pieces ---------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc(taps)

    def _extra_layers(self):
        return [self.layers[k] for k in sorted(self.layers, key=int)]

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in range(self.draft_config.num_layers)]

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        cos, sin = self.rotary(hidden, position_ids)
        h = self.midlayer(hidden, self.embed(input_ids), cos, sin, caches[0], mask)
        for layer, cache in zip(self._extra_layers(), caches[1:]):
            h = layer(h, None, cos, sin, cache, mask)
        return h, self.target_logits(self.lm_head(self.norm(h)))

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab logits into the target vocab (-inf elsewhere) so proposers speak target ids."""
        if self.d2t.numel() == self.t2d.numel():
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.t2d.numel()), float("-inf"))
        out[..., self.draft_to_target] = draft_logits
        return out

    # -- training ------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], features: TargetFeatures) -> StepOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].to(features.logits.dtype)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        with torch.no_grad():
            target_ids = features.logits.argmax(-1)
            in_vocab = self.t2d[target_ids].to(loss_mask.dtype)
            target_p = torch.softmax(features.logits.index_select(-1, self.draft_to_target).float(), dim=-1)
        hidden = self.fuse(features.hidden.to(self.fc.weight.dtype))
        blocks = [[] for _ in range(self.draft_config.num_layers)]
        total, metrics, accuracies = 0.0, {}, []
        for i in range(self.draft_config.ttt_steps):
            # Step i at position t: hidden for t (real at i=0, the draft's own after), embedding of the true
            # token t+1+i; it predicts token t+2+i, whose target distribution sits at position t+1+i.
            tokens = shift_left(input_ids, 1 + i)
            p, want = shift_left(target_p, 1 + i), shift_left(target_ids, 1 + i)
            trainable = shift_left(loss_mask, 2 + i)
            cos, sin = self.rotary(hidden, positions + i)
            h = self.midlayer.forward_ttt(hidden, self.embed(tokens), cos, sin, blocks[0])
            for layer, layer_blocks in zip(self._extra_layers(), blocks[1:]):
                h = layer.forward_ttt(h, None, cos, sin, layer_blocks)
            logits = self.lm_head(self.norm(h))
            loss_i = soft_cross_entropy(logits, p, trainable * shift_left(in_vocab, 1 + i))
            total = total + self.draft_config.step_decay**i * loss_i
            with torch.no_grad():
                guess = self.draft_to_target[logits.argmax(-1)]
                acc = ((guess == want).to(trainable.dtype) * trainable).sum() / trainable.sum().clamp(min=1)
            accuracies.append(float(acc))
            metrics[f"loss_{i}"], metrics[f"acc_{i}"] = float(loss_i.detach()), float(acc)
            hidden = h
        return StepOutput(loss=total, metrics=metrics, step_accuracies=accuracies)
