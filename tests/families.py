"""Tiny random targets of every decoder-only family people serve, built from transformers' own config and model
classes (nothing forked, nothing downloaded), with SmolLM2's tokenizer. Each family's windows, chunks and linear
layers are small enough that a test's prompt passes them: a sliding window of 8 tokens, attention chunks of 8,
linear-attention and SSM layers beside full attention in four layers.

``CACHE_KIND`` names how each family's cache rolls back: full attention only; sliding or chunked attention (a
window past which old positions leave the cache); recurrent (linear-attention or SSM states, no per-position
record); convolution only (short conv states, cropped); MLA (compressed latent keys)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 49152  # SmolLM2's tokenizer
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=None)  # SmolLM2's <|im_start|>, <|im_end|>; no padding
WINDOW = 8
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (model_type, config overrides on SMALL)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW,
                               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW,
                            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "exaone4": ("exaone4", {"sliding_window": WINDOW,
                            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "gpt_oss": ("gpt_oss", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                            "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "llama4": ("llama4_text", {"attention_chunk_size": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1,
                               "intermediate_size_mlp": 128, "no_rope_layer_interval": 2,
                               "interleave_moe_layer_step": 2}),
    "deepseek_v3": ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16,
                                    "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                    "v_head_dim": 16, "num_key_value_heads": 4, "head_dim": 8}),
    "qwen3_next": ("qwen3_next", {**MOE, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                  "shared_expert_intermediate_size": 32,
                                  "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "qwen3_5": ("qwen3_5_text", {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                                 "linear_num_value_heads": 4,
                                 "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**MOE, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                         "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                         "shared_expert_intermediate_size": 32,
                                         "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "falcon_h1": ("falcon_h1", {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_d_conv": 4,
                                "mamba_chunk_size": 8, "mamba_expand": 1}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "block_multiple_of": 16,
                      "block_auto_adjust_ff_dim": False}),
}

CACHE_KIND = {
    **dict.fromkeys(["llama", "qwen2", "qwen3", "phi3", "olmo2", "smollm3", "qwen3_moe", "mixtral", "glm4_moe"],
                    "full"),
    **dict.fromkeys(["mistral", "gemma2", "gemma3", "cohere2", "exaone4", "gpt_oss", "llama4"], "sliding"),
    "deepseek_v3": "mla",
    **dict.fromkeys(["qwen3_next", "qwen3_5", "qwen3_5_moe", "falcon_h1"], "recurrent"),
    "lfm2": "conv",
}
MOE_FAMILIES = ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "llama4", "deepseek_v3", "qwen3_next", "qwen3_5_moe"]
# one family of each cache kind, for the slower checks (sampling's chi-squared test, exports)
ONE_PER_CACHE_KIND = {"full": "qwen3_moe", "sliding": "gemma3", "mla": "deepseek_v3", "recurrent": "qwen3_next",
                      "conv": "lfm2"}


def family_config(family: str, **changes):
    model_type, overrides = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**SMALL, **overrides, **changes})


def family_model(family: str, seed: int = 0, **changes) -> torch.nn.Module:
    """The family's tiny random causal LM (float32, eval mode, frozen as a loaded target is), seeded."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **changes)).eval().requires_grad_(False)
    with torch.no_grad():  # every matrix at unit gain: each layer (a state, a window) changes the logits
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    return model


def noised(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy with Gaussian noise (``scale`` of each matrix's std) on its decoder matrices: a draft that accepts
    some of the model's tokens and refuses others."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if param.dim() == 2 and "embed" not in name and "lm_head" not in name:
                param.add_(torch.randn(param.shape, generator=g) * scale * param.std())
    return out
