"""EAGLE-1/2 head: fc over [token embedding, last target hidden] (2H -> H), decoder layer(s), and the target's
own (frozen) lm_head. Trained by feature regression (smooth-L1) plus cross-entropy against the target's
next-token distribution, with uniform input noise (as in EAGLE-1). EAGLE-2 differs only at inference (dynamic
draft trees), which the proposer provides. Layout as SafeAILab/EAGLE and vLLM expect: ``fc``, ``layers.{i}.*``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from drafttrain import DrafttrainError
from drafttrain.config import EagleConfig
from drafttrain.drafts import losses
from drafttrain.drafts.base import Exported, StepOutput, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import (
    DraftDecoderLayer,
    check_target_sizes,
    foreign_tensors,
    llama_config_like,
    shift_left,
)
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs


class EagleDrafter(EagleHead):
    kind = "eagle"
    description = "an EAGLE-1/2 head on the target's last hidden state"
    engine_methods = {"vllm": "eagle", "sglang": "EAGLE"}
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
    def build(cls, config: EagleConfig, target, run=None) -> "EagleDrafter":
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
    def from_pretrained(cls, directory, target) -> "EagleDrafter":
        config = cls.read_checked_config(directory, target)
        cfg = EagleConfig.model_validate(config["drafttrain"]["draft"])
        head = cls(cfg, llama_config_like(target.config, **saved_layer_fields(config)), target.num_layers)
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    @classmethod
    def target_needs(cls, config: EagleConfig, target) -> TargetNeeds:
        return TargetNeeds(layers=(target.num_layers,), logits=True)

    def interchange_config(self) -> dict:
        return {"architectures": ["EagleLlamaForCausalLM"], **self.llama_fields(), "bias": True}

    # -- export -------------------------------------------------------------------------------------------
    formats = ("vllm", "sglang")

    def exported(self, fmt: str) -> Exported:
        """vLLM builds fc without a bias and reads ``bias`` as "every attention projection has one" (which it then
        never finds, so they stay random). The fc bias b is folded into layer 0's attention instead, exactly: layer
        0 reads x = W·[e, h] + b un-normed, so q, k, v gain biases Wq·b, Wk·b, Wv·b, and the residual gains b,
        which o_proj's bias adds. The other layers get zero biases. SGLang builds fc with a bias (its default)."""
        config, tensors = self.checkpoint_config(export={"format": fmt}), self.state_tensors()
        config.pop("bias")  # both engines read it as "every attention projection has a bias"
        if fmt == "sglang":  # its fc always has a bias; the head's attention has none
            return Exported(config, tensors)
        config["attention_bias"] = True
        fc_bias = tensors.pop("fc.bias")
        for index in range(self.config.num_layers):
            prefix = f"layers.{index}.self_attn."
            for name in ("q_proj", "k_proj", "v_proj"):
                weight = tensors[prefix + name + ".weight"]
                tensors[prefix + name + ".bias"] = weight @ fc_bias if index == 0 else weight.new_zeros(weight.shape[0])
            tensors[prefix + "o_proj.bias"] = fc_bias.clone() if index == 0 else torch.zeros_like(fc_bias)
        return Exported(config, tensors, notes=["fc's bias is folded into layer 0's attention biases (vLLM's fc "
                                                "has none); the computation is the same"])

    @classmethod
    def imported(cls, fmt, config, tensors):
        config, tensors = {**config, "bias": True}, dict(tensors)
        if fmt == "sglang":
            return config, tensors
        config.pop("attention_bias", None)
        fc_bias = tensors["layers.0.self_attn.o_proj.bias"]
        for key in [k for k in tensors if k.startswith("layers.") and k.endswith("_proj.bias")]:
            weight = tensors[key.removesuffix(".bias") + ".weight"]
            folded = weight @ fc_bias if key.startswith("layers.0.") and "o_proj" not in key else None
            expected = fc_bias if key == "layers.0.self_attn.o_proj.bias" else \
                folded if folded is not None else torch.zeros_like(tensors[key])
            if not torch.allclose(tensors.pop(key), expected, atol=1e-4, rtol=1e-3):
                raise DrafttrainError(f"{key} is not a folded fc bias: this vLLM EAGLE folder was not written by "
                                      "drafttrain export, and its attention biases have no place in this head")
        tensors["fc.bias"] = fc_bias
        return config, tensors

    # -- import (a head EAGLE's own trainer wrote) -----------------------------------------------------------
    foreign_formats = ("eagle",)

    @classmethod
    def foreign_format(cls, config):
        # EAGLE's trainer (eagle/train/main.py) saves the head beside its train config: a plain Llama config (its
        # EAGLE-3 trainer's config adds draft_vocab_size: not an EAGLE-1 head)
        plain = config.get("architectures") == ["LlamaForCausalLM"] and "draft_vocab_size" not in config
        return "eagle" if plain else None

    @classmethod
    def foreign_draft(cls, config, tensors, target):
        """An EAGLE-1/2 head as EAGLE's trainer saves it (the state dict of ``eagle.model.cnets1.Model``, which
        ``EaModel`` loads): ``fc`` over [embedding, hidden] (2H wide), with a bias as the config's ``bias`` says
        (default true); ``layers.{i}.*``, layer 0 without an input norm, built from the head's own config (its norm
        epsilon, heads and RoPE base need not be the target's); the target's embedding, frozen (checked against this
        target's, then left out: the head reads the target's own)."""
        fc, h = tensors.get("fc.weight"), target.hidden_size
        if fc is None or tuple(fc.shape) != (h, 2 * h) or any(k.startswith("midlayer.") for k in tensors):
            raise DrafttrainError(f"the folder holds no EAGLE-1/2 head for hidden size {h} (its fc.weight is "
                                  f"{None if fc is None else tuple(fc.shape)}, EAGLE-1's is {(h, 2 * h)}): an EAGLE-3 "
                                  "head, another target's, or a model's own folder?")
        for field, why in (("qkv_bias", "biases on q, k and v"), ("rope_scaling", "a scaled RoPE")):
            if config.get(field):
                raise DrafttrainError(f"the head sets {field} ({why}), which drafttrain's EAGLE head does not compute")
        if bool(config.get("bias", True)) != ("fc.bias" in tensors):  # EaModel builds fc as the config says
            raise DrafttrainError(f"the config says bias {config.get('bias', True)} but the weights "
                                  f"{'hold' if 'fc.bias' in tensors else 'lack'} fc.bias: EAGLE would load it otherwise")
        check_target_sizes(config, target, "the head's")
        _check_same_embedding(tensors.get("embed_tokens.weight"), target)
        tensors, notes = foreign_tensors(tensors), []
        if "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(h)
            notes.append("the head's fc has no bias: drafttrain's has one, set to zero (the same computation)")
        fields = eagle_layer_fields(config)
        draft = EagleConfig(num_layers=fields["num_hidden_layers"], intermediate_size=fields["intermediate_size"])
        return draft, {k: v for k, v in fields.items() if k != "bias"}, tensors, notes

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


def eagle_layer_fields(config: dict) -> dict:
    """An EAGLE-1 train config with the values EAGLE's code takes for the fields it leaves out or sets to null
    (eagle/model/configs.py and cnets1.py: KV heads = heads, head_dim = hidden / heads always, RoPE base 10000)."""
    heads = config["num_attention_heads"]
    defaults = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0, "num_key_value_heads": heads}
    fields = {**config, **{k: v for k, v in defaults.items() if config.get(k) is None}}
    return {**fields, "head_dim": config["hidden_size"] // heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"]}}


def saved_layer_fields(config: dict) -> dict:
    """The draft layers' shape as a checkpoint's config.json records it (drafttrain's own record the target's; an
    imported head's, its own)."""
    names = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
             "hidden_act", "rope_parameters")
    return {k: config[k] for k in names if config.get(k) is not None}


def _check_same_embedding(embedding: torch.Tensor | None, target) -> None:
    """EAGLE trains its head on a frozen copy of the target's embedding: another one means another target."""
    if embedding is None:
        return
    ours = target.model.get_input_embeddings().weight.detach().float().cpu()
    if embedding.shape != ours.shape or not torch.allclose(embedding.float(), ours, rtol=1e-2, atol=1e-3):
        raise DrafttrainError("the head's embed_tokens is not this target's embedding: it was trained for another "
                              f"target than {target.name!r} (EAGLE copies and freezes its target's embedding)")
