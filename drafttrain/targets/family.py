"""What a draft layer mirrors of its target's config, read the way each family names it.

A draft layer (EAGLE's, DFlash's) is a dense Llama-style layer shaped like the target's attention: its heads, head
size, RoPE and norm epsilon (its activation is SiLU, the one engines serve). Families name and nest these
differently: Gemma's RoPE is given per layer type (local and global); LFM2's epsilon is ``norm_eps``;
MLA's ``head_dim`` is only the rotary part of a head (DeepSeek-V3, Kimi-K2), so the draft takes the Llama split
of the hidden size instead."""

from __future__ import annotations

from typing import Any

EPSILON_NAMES = ("rms_norm_eps", "norm_eps", "layer_norm_eps")


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def is_mla(config) -> bool:
    """Multi-head latent attention: keys and values from a low-rank latent (DeepSeek-V3, Kimi-K2)."""
    return bool(getattr(text_config(config), "kv_lora_rank", None))


def draft_layer_fields(config) -> dict[str, Any]:
    """The fields of a Llama config for a draft layer shaped like the target's."""
    text = text_config(config)
    heads = text.num_attention_heads
    fields: dict[str, Any] = dict(
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        rms_norm_eps=next((getattr(text, n) for n in EPSILON_NAMES if getattr(text, n, None)), 1e-6),
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        vocab_size=text.vocab_size,
        # the draft layer's own activation, not the target's: engines' EAGLE layers compute SiLU only (vLLM's
        # LlamaMLP refuses Gemma's gelu_pytorch_tanh)
        hidden_act="silu",
    )
    head_dim = getattr(text, "head_dim", None)
    if head_dim and not is_mla(text):
        fields["head_dim"] = head_dim
    rope = full_attention_rope(text)
    if rope:
        fields["rope_parameters"] = rope
    return fields


def full_attention_rope(config) -> dict | None:
    """The RoPE of the target's full-attention layers (a family that gives one per layer type: its global one)."""
    rope = getattr(text_config(config), "rope_parameters", None)
    if not rope:
        return None
    rope = dict(rope)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return dict(rope.get("full_attention") or next(iter(rope.values())))
    return rope
