"""Tiny random targets of every decoder-only family people serve, built from transformers' own config and model
classes (nothing forked, nothing downloaded), with SmolLM2's tokenizer. Each family's windows, chunks and linear
layers are small enough that a test's prompt passes them: a sliding window of 8 tokens, attention chunks of 8,
linear-attention and SSM layers beside full attention in four layers.

``CACHE_KIND`` names how each family's cache rolls back: full attention only; sliding or chunked attention (a
window past which old positions leave the cache); recurrent (linear-attention or SSM states, no per-position
record); convolution only (short conv states, cropped); MLA (compressed latent keys).

``PUBLISHED_CACHE_KIND`` names real published ``config.json`` files (tests/published_configs/, sources in its
SOURCES.md); ``published_model`` builds each with every field as published and only its sizes shrunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from drafttrain import DrafttrainError
from drafttrain.config import parse_recipe
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.decoding.trees import DynamicTree
from drafttrain.drafts import build_drafter
from drafttrain.evaluation.evaluate import evaluate
from drafttrain.targets import Target, TargetNeeds, run_target
from drafttrain.training.plan import plan

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
    return random_model(family_config(family, **changes), seed)


def random_model(config, seed: int = 0) -> torch.nn.Module:
    """A random causal LM of ``config`` (float32, eval mode, frozen as a loaded target is), seeded."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
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



# ------------------------------------------------------------------------------------ multi-token-prediction layers

# the families whose published checkpoints ship an MTP layer (Kimi-K2 is DeepSeek-V3's layout), and the MoE and dense
# Qwen3.5 both
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
# where the published checkpoints keep it: DeepSeek-V3 / GLM-4.5 as decoder layer L with its extras beside (and
# copies of the embedding and lm_head, which nothing reads), the Qwens beside the model under mtp.*
MTP_PARTS = {"layers": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"},
             "mtp": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                     "post_norm": "norm"}}


def mtp_ready(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as transformers' MtpModel takes it: the Qwens' configs do not count their MTP layer (one, full
    attention), and DeepSeek-V3 / GLM-4.5 find theirs at the published layer number (61, 46 or 92) unless told the
    tiny one."""
    config, layers = model.config, model.config.num_hidden_layers
    if getattr(config, "num_mtp_layers", None) is None:
        config.num_mtp_layers, config.mtp_layer_types = 1, ["full_attention"]
    else:
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers}\..*"]
    return model


def save_with_native_mtp(model: torch.nn.Module, folder: Path, tokenizer, seed: int = 1) -> dict[str, torch.Tensor]:
    """Save ``model`` as a model folder whose checkpoint ships a random MTP layer under the published keys (its
    experts one by one, as the published files hold them), built and written by transformers alone. Returns the
    layer's state (transformers' MtpLayer names)."""
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_layers import MtpModel

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    layers, beside = model.config.num_hidden_layers, getattr(model.config, "num_mtp_layers", None) is None
    torch.manual_seed(seed)
    layer = MtpModel(mtp_ready(model), 1).layers[0]
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.2 if param.dim() < 2 else param.shape[-1] ** -0.5)
    state = {name: value.detach().clone() for name, value in layer.state_dict().items()}
    prefix, block = ("mtp.", "mtp.layers.0.") if beside else (f"model.layers.{layers}.",) * 2
    native = revert_weight_conversion(model, {block + name.removeprefix("mtp_block."): value
                                              for name, value in state.items() if name.startswith("mtp_block.")})
    for part, name in MTP_PARTS["mtp" if beside else "layers"].items():
        native[f"{prefix}{name}.weight"] = state[f"{part}.weight"]
    if not beside:  # the copies DeepSeek-V3's checkpoint holds beside its MTP layer
        native[f"{prefix}embed_tokens.weight"] = model.get_input_embeddings().weight
        native[f"{prefix}shared_head.head.weight"] = model.get_output_embeddings().weight
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({name: value.detach().contiguous() for name, value in native.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return state

# ---------------------------------------------------------------------------------------- published configs

PUBLISHED = Path(__file__).parent / "published_configs"
# each published config -> how its cache rolls back (the CACHE_KIND vocabulary); Kimi Linear's KDA layers sit beside
# MLA ones and are the ones that decide its rollback (recurrent states) and its refusal of trees
PUBLISHED_CACHE_KIND = {
    "qwen3_next_80b_a3b_thinking": "recurrent", "qwen3_5_27b": "recurrent", "qwen3_5_35b_a3b": "recurrent",
    "deepseek_v3": "mla", "kimi_k2_instruct": "mla", "glm4_5_air": "full", "gpt_oss_20b": "sliding",
    "gemma3_27b_it": "sliding", "llama4_scout_17b_16e_instruct": "sliding", "devstral_small_2507": "full",
    "lfm2_1_2b": "conv", "smollm3_3b": "full", "kimi_linear_48b_a3b": "recurrent",
    "falcon_h1_0_5b_instruct": "recurrent", "phi_4_mini_instruct": "full",
}

# sizes: each field's tiny value (None stays None: a window or rank the model does not have)
TINY_SIZES = {
    "intermediate_size": 128, "intermediate_size_mlp": 128, "block_ff_dim": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "v_head_dim": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 24,
    "num_heads": 4, "linear_num_heads": 4,
    "vocab_size": VOCAB, "max_position_embeddings": 2048, "model_max_length": 2048,
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW,  # smaller than a test prompt: passed by it
}
HIDDEN_WIDTHS = ("hidden_size", "block_dim", "conv_dim", "conv_dim_out")  # the model's width, however named
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
TINY_EXPERTS = 16  # >= every published top-k, and two per group for eight groups (DeepSeek-V3)
# head counts shrink together, their ratio (queries per key-value head, value heads per key head) kept
HEAD_PAIRS = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
TOKEN_IDS = {"bos_token_id": SMALL["bos_token_id"], "eos_token_id": SMALL["eos_token_id"], "pad_token_id": None}
# fields that list layer indices (0- or 1-based): kept for the layers left
LAYER_INDICES = {"full_attn_idxs": 0, "mlp_only_layers": 0, "moe_layers": 0, "full_attn_layers": 1, "kda_layers": 1}
WINDOWS = ("sliding_window", "attention_chunk_size")
ROTARY_FACTORS = ("short_factor", "long_factor")  # LongRoPE's per-frequency factors, sized by the rotary half
NOT_ARCHITECTURE = ("quantization_config",)  # how the published weights are stored; a random float32 model has none
MIN_LAYERS = 4


def published_file(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def published_text(name: str) -> dict:
    """The text model's config as published (a multimodal wrapper's ``text_config``)."""
    published = published_file(name)
    return published.get("text_config", published)


def config_class(text: dict):
    """transformers' config class for a published text config: by its model type, or (a type transformers does
    not register, Kimi-K2's ``kimi_k2``) by the architecture it names (DeepseekV3ForCausalLM)."""
    if text["model_type"] in CONFIG_MAPPING:
        return CONFIG_MAPPING[text["model_type"]]
    return getattr(transformers, text["architectures"][0]).config_class


def shrunk_config(name: str, layers: int | None = None) -> dict:
    """The published text config with only its sizes shrunk (``layers``: the first that many; None: as many as
    the published layer pattern needs to show every kind of layer it has, at least ``MIN_LAYERS``)."""
    text = published_text(name)
    layers = layers or layers_needed(name)
    heads = _shrunk_heads(text)
    sizes = {**TINY_SIZES, **dict.fromkeys(HIDDEN_WIDTHS, _tiny_width(text, heads))}
    out = {key: _shrunk(key, value, text, layers, sizes) for key, value in text.items()
           if key not in NOT_ARCHITECTURE}
    out.update(heads, **TOKEN_IDS, vocab_size=VOCAB, num_hidden_layers=layers,  # a default vocabulary shrunk too
               model_type=config_class(text).model_type)
    if "head_dim" not in text and "kv_lora_rank" not in text:  # a head size the tiny width would not divide
        out["head_dim"] = TINY_SIZES["head_dim"]
    return out


def _shrunk(key: str, value, text: dict, layers: int, sizes: dict):
    if isinstance(value, dict):
        return {k: _shrunk(k, v, text, layers, sizes) for k, v in value.items()}
    if key == "mrope_section":  # rotary frequencies per position axis: they add up to half the rotary size
        return _split(value, _rotary_half(text))
    if key in ROTARY_FACTORS:  # one factor per rotary frequency (LongRoPE): as many as the tiny head has
        return _spread(value, _rotary_half(text))
    if key in WINDOWS and value is not None and value >= text.get("max_position_embeddings", float("inf")):
        return value  # longer than any sequence the model takes, it never slides (Phi-4-mini's): kept as is
    if key == "max_position_embeddings" and _rope_original_length(text):
        return value  # its ratio to the RoPE's original context is part of the RoPE (YaRN, Llama 3 scaling)
    if key in sizes and value is not None:
        return sizes[key]
    if key in EXPERT_COUNTS:
        return min(value, TINY_EXPERTS)
    if key in LAYER_INDICES:
        return [i for i in value if i - LAYER_INDICES[key] < layers]
    if isinstance(value, list) and len(value) == text["num_hidden_layers"]:  # one entry per layer
        return value[:layers]
    return value


def _shrunk_heads(text: dict) -> dict:
    """Head counts, about four, with the published ratio in each pair."""
    out = {}
    for many, few in HEAD_PAIRS:
        if many in text:
            ratio = text[many] // text[few] if text.get(few) else 1
            out[many] = max(1, 4 // ratio) * ratio
            if text.get(few):
                out[few] = out[many] // ratio
    return out


def _tiny_width(text: dict, heads: dict) -> int:
    """64, or a multiple of the query heads where the published width is one (and 64 is not)."""
    width, query_heads = 64, heads.get("num_attention_heads")
    if query_heads and text["hidden_size"] % text["num_attention_heads"] == 0 and width % query_heads:
        return query_heads * TINY_SIZES["head_dim"]
    return width


def _rope(text: dict) -> dict:
    return text.get("rope_parameters") or text.get("rope_scaling") or {}


def _rope_original_length(text: dict) -> int | None:
    """The RoPE's original context, in its parameters or (Phi-3's LongRoPE) beside them."""
    return _rope(text).get("original_max_position_embeddings") or text.get("original_max_position_embeddings")


def _rotary_half(text: dict) -> int:
    rope = _rope(text)
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    return int(TINY_SIZES["head_dim"] * partial) // 2


def _spread(values: list, count: int) -> list:
    """``count`` of ``values``, each as published, spread evenly from the first to the last."""
    step = (len(values) - 1) / max(count - 1, 1)
    return [values[round(i * step)] for i in range(count)]


def _split(parts: list[int], total: int) -> list[int]:
    """``parts`` scaled to add up to ``total`` (largest remainders first)."""
    exact = [p * total / sum(parts) for p in parts]
    out = [int(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def layers_needed(name: str) -> int:
    """The fewest first layers that show every kind of layer the published model has (attention type, RoPE or
    not, dense MLP or experts...), at least ``MIN_LAYERS``."""
    kinds = layer_kinds(published_model_on_meta(name))
    return max(MIN_LAYERS, max(kinds.index(kind) for kind in set(kinds)) + 1)


def published_config(name: str, layers: int | None = None):
    """The tiny model's config: the published one with only its sizes shrunk."""
    text = shrunk_config(name, layers)
    return config_class(text)(**text)


def published_model_on_meta(name: str) -> torch.nn.Module:
    """The published model at its full size, on the meta device (its structure, no memory)."""
    text = {key: value for key, value in published_text(name).items() if key not in NOT_ARCHITECTURE}
    text["model_type"] = config_class(text).model_type
    return random_model_on_meta(config_class(text)(**text))


def published_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The published config's tiny random causal LM (float32, eval mode, frozen), seeded. An embedding the model
    scales up (Gemma's by the square root of the hidden size) is at unit gain after its scale: tied to the output
    as published, it would otherwise outweigh every layer and the model repeat one token."""
    model = random_model(published_config(name), seed)
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        embedding.weight.div_(float(getattr(embedding, "embed_scale", 1.0)))
    return model


def random_model_on_meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def layer_kinds(model: torch.nn.Module) -> list[tuple]:
    """Per decoder layer: its layer type, and each module's class and RoPE use, so layers of one kind compare
    equal."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    return [(types[i],) + tuple((name, type(m).__name__, getattr(m, "use_rope", None))
                                for name, m in layer.named_modules())
            for i, layer in enumerate(model.model.layers)]


# ---------------------------------------------------------------------------------------- what every family passes

NEW = 40
SHAPES = {"chain": dict(depth=3), "static_tree": dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
          "dynamic_tree": dict(tree=DynamicTree(total_tokens=8, depth=3, top_k=3))}
TREES_REFUSED = {"recurrent", "conv"}  # one forward cannot verify branches through layers that run tokens in order
KINDS = {"eagle3": {"kind": "eagle3"}, "eagle": {"kind": "eagle"}, "medusa": {"kind": "medusa"},
         "peagle": {"kind": "eagle3", "parallel": {"depths": 3}}, "dflash": {"kind": "dflash"},
         "draft_model": {"kind": "draft_model", "cut": "first:2"},
         "pard": {"kind": "draft_model", "cut": "first:2", "parallel": {"depths": 3}}}


def story_prompt(tokenizer) -> list[int]:
    """A chat prompt longer than every window and chunk of the matrix (its first forward passes them all)."""
    messages = [{"role": "user", "content": "Tell me a long story about a cat and a dog."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert len(ids) > 3 * WINDOW
    return ids


def mixed_draft(target: Target, prompt: list[int]) -> Target:
    """The target noised just enough that, as a chain's draft, it has tokens accepted and refused on ``prompt``
    (the noise a family tolerates differs: the first scale that does both)."""
    for scale in (0.1, 0.03, 0.3, 0.01, 1.0):
        draft = Target(f"{target.name}-noised", noised(target.model, scale), target.tokenizer)
        stats = SpeculativeDecoder(target, build_proposer("draft_model", target, draft=draft), depth=3) \
            .generate(prompt, NEW).stats
        if sum(stats.accepted_per_step) > 0 and sum(stats.rejected_per_step) >= 3:
            return draft
    raise AssertionError(f"no noise scale gives {target.name} a draft that both accepts and refuses")


def check_plain_decoding_is_hf_generate(target: Target, prompt: list[int]) -> None:
    ours = plain_decode(target, prompt, NEW).tokens
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == hf


def check_speculative_decoding_is_plain(target: Target, draft: Target, prompt: list[int], shape: str,
                                        cache_kind: str) -> None:
    """Past every window and chunk, and past refused drafts: the cache rolled back exactly (targets.cache); a
    tree refused where the cache cannot verify one."""
    reference = plain_decode(target, prompt, NEW).tokens
    proposer = build_proposer("draft_model", target, draft=draft)
    if shape != "chain" and cache_kind in TREES_REFUSED:
        with pytest.raises(DrafttrainError, match="run the fed tokens in order.*Use a chain"):
            SpeculativeDecoder(target, proposer, **SHAPES[shape])
        return
    decoder = SpeculativeDecoder(target, proposer, **SHAPES[shape])
    out = decoder.generate(prompt, NEW)
    assert out.tokens == reference
    stats = out.stats
    assert sum(stats.accepted_per_step) > 0  # nodes kept (a tree's moved into place)
    if shape == "chain":
        assert any(stats.rejected_per_step)  # and refused ones dropped
    assert decoder.cache.length == len(prompt) + NEW - 1


def check_taps_are_the_models_own(target: Target, prompt: list[int]) -> None:
    ids = torch.tensor([prompt])
    layers = target.num_layers
    out = run_target(target, {"input_ids": ids}, TargetNeeds(layers=(1, layers - 1), final_hidden=True, logits=True))
    with torch.no_grad():
        hf = target.model(ids, output_hidden_states=True)
    width = target.hidden_size
    torch.testing.assert_close(out.hidden[..., :width], hf.hidden_states[1])
    torch.testing.assert_close(out.hidden[..., width:], hf.hidden_states[layers - 1])
    torch.testing.assert_close(out.final, hf.hidden_states[layers])
    torch.testing.assert_close(out.logits, hf.logits, atol=1e-5, rtol=1e-5)


def check_one_training_step(target: Target, prompt: list[int], tokenizer, kinds: dict = KINDS) -> None:
    """One training step of each kind: a finite loss, gradients on the draft and none on the frozen target."""
    answer = tokenizer("Once upon a time a cat met a dog in a big green garden.")["input_ids"]
    ids = torch.tensor([prompt + answer])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, len(prompt):] = 1
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    for kind, section in kinds.items():
        torch.manual_seed(0)
        drafter = build_drafter(parse_recipe({"draft": section}).draft, target).train()
        result = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
        result.loss.backward()
        trained = [p for p in drafter.parameters() if p.requires_grad]
        assert torch.isfinite(result.loss), kind
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained), kind
        assert not any(p.grad is not None for p in target.model.parameters()), kind  # the target stays frozen


def check_the_evaluator_is_lossless(target: Target, prompt: list[int], tokenizer, kind: str) -> None:
    """The kind's own proposer (the target's taps read while it decodes) against plain decoding in one run."""
    torch.manual_seed(0)
    drafter = build_drafter(parse_recipe({"draft": KINDS[kind]}).draft, target).eval()
    report = evaluate(target, drafter, [tokenizer.decode(prompt)], depth=3, max_new_tokens=24, progress=False,
                      warmup=False)
    assert report.overall["greedy_match"] == 1.0


def check_plan_counts_every_weight(target: Target, config, folder: Path) -> dict:
    """plan builds the target on the meta device from its config alone: every expert's weights counted. Returns
    the config.json it read."""
    config.save_pretrained(folder)
    recipe = parse_recipe({"target": {"model": str(folder)}, "draft": {"kind": "eagle3"},
                           "wandb": {"mode": "disabled"}})
    result = plan(recipe, stage="train", config_path=str(folder))
    assert result.memory["target weights"] == sum(p.numel() * p.element_size() for p in target.model.parameters())
    return json.loads((folder / "config.json").read_text())
