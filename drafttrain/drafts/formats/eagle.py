"""EAGLE-1/2's serving formats: the layouts vLLM (``vllm``, fc's bias folded into layer 0's attention) and SGLang
(``sglang``) load, and the heads EAGLE's own trainer writes."""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError
from drafttrain.config import EagleConfig
from drafttrain.drafts.codecs import Codec, Exported, ForeignReader
from drafttrain.drafts.eagle import EagleDrafter
from drafttrain.drafts.layers import check_target_sizes, foreign_tensors
from drafttrain.targets import Target


class Interchange(Codec):
    def __init__(self, fmt: str):
        self.fmt = fmt
        self.engines = {"vllm": "eagle"} if fmt == "vllm" else {"sglang": "EAGLE"}

    def write(self, drafter: EagleDrafter) -> Exported:
        """vLLM builds fc without a bias and reads ``bias`` as "every attention projection has one" (which it then
        never finds, so they stay random). The fc bias b is folded into layer 0's attention instead, exactly: layer
        0 reads x = W·[e, h] + b un-normed, so q, k, v gain biases Wq·b, Wk·b, Wv·b, and the residual gains b,
        which o_proj's bias adds. The other layers get zero biases. SGLang builds fc with a bias (its default)."""
        config, tensors = drafter.checkpoint_config(export={"format": self.fmt}), drafter.state_tensors()
        config.pop("bias")  # both engines read it as "every attention projection has a bias"
        if self.fmt == "sglang":  # its fc always has a bias; the head's attention has none
            return Exported(config, tensors)
        config["attention_bias"] = True
        fc_bias = tensors.pop("fc.bias")
        for index in range(drafter.config.num_layers):
            prefix = f"layers.{index}.self_attn."
            for name in ("q_proj", "k_proj", "v_proj"):
                weight = tensors[prefix + name + ".weight"]
                tensors[prefix + name + ".bias"] = weight @ fc_bias if index == 0 else weight.new_zeros(weight.shape[0])
            tensors[prefix + "o_proj.bias"] = fc_bias.clone() if index == 0 else torch.zeros_like(fc_bias)
        return Exported(config, tensors, notes=["fc's bias is folded into layer 0's attention biases (vLLM's fc "
                                                "has none); the computation is the same"])

    def read(self, config, tensors):
        config, tensors = {**config, "bias": True}, dict(tensors)
        if self.fmt == "sglang":
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



class EagleTrained(ForeignReader):
    fmt = "eagle"

    def recognises(self, config) -> bool:
        # EAGLE's trainer (eagle/train/main.py) saves the head beside its train config: a plain Llama config (its
        # EAGLE-3 trainer's config adds draft_vocab_size: not an EAGLE-1 head)
        plain = config.get("architectures") == ["LlamaForCausalLM"] and "draft_vocab_size" not in config
        return plain

    def read_foreign(self, config, tensors, target: Target):
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


def eagle_layer_fields(config: dict) -> dict:
    """An EAGLE-1 train config with the values EAGLE's code takes for the fields it leaves out or sets to null
    (eagle/model/configs.py and cnets1.py: KV heads = heads, head_dim = hidden / heads always, RoPE base 10000)."""
    heads = config["num_attention_heads"]
    defaults = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0, "num_key_value_heads": heads}
    fields = {**config, **{k: v for k, v in defaults.items() if config.get(k) is None}}
    return {**fields, "head_dim": config["hidden_size"] // heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"]}}


def _check_same_embedding(embedding: torch.Tensor | None, target: Target) -> None:
    """EAGLE trains its head on a frozen copy of the target's embedding: another one means another target."""
    if embedding is None:
        return
    ours = target.model.get_input_embeddings().weight.detach().float().cpu()
    if embedding.shape != ours.shape or not torch.allclose(embedding.float(), ours, rtol=1e-2, atol=1e-3):
        raise DrafttrainError("the head's embed_tokens is not this target's embedding: it was trained for another "
                              f"target than {target.name!r} (EAGLE copies and freezes its target's embedding)")


EAGLE_CODECS = [Interchange("vllm"), Interchange("sglang")]
EAGLE_READERS = [EagleTrained()]
