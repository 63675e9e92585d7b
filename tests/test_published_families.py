"""The family matrix from real published config.json files (tests/published_configs/, sources in its SOURCES.md):
each model built by transformers' own classes with every field as published (layer-type patterns, windows and
chunks, head ratios, RoPE settings, MoE routing, MLA ranks, MTP layer counts) and only its sizes shrunk, then put
through the checks every hand-written family passes (tests/test_families.py): plain decoding equal to HF generate,
speculative decoding equal to plain decoding past every window and refused draft, taps, a training step of every
kind, the evaluator and plan. Hand-written configs that pass while a published one fails is how a defect reaches
users."""

from __future__ import annotations

import pytest
from families import (
    EXPERT_COUNTS,
    HEAD_PAIRS,
    HIDDEN_WIDTHS,
    LAYER_INDICES,
    NOT_ARCHITECTURE,
    PUBLISHED,
    PUBLISHED_CACHE_KIND,
    SHAPES,
    TINY_SIZES,
    VOCAB,
    WINDOW,
    check_one_training_step,
    check_plain_decoding_is_hf_generate,
    check_plan_counts_every_weight,
    check_speculative_decoding_is_plain,
    check_taps_are_the_models_own,
    check_the_evaluator_is_lossless,
    config_class,
    layer_kinds,
    mixed_draft,
    published_config,
    published_model,
    published_model_on_meta,
    published_text,
    random_model_on_meta,
    shrunk_config,
    story_prompt,
)

from drafttrain.targets import Target, load_tokenizer

# what the matrix may shrink: sizes (widths, depth, expert count, vocabulary and the token ids in it, positions,
# windows and chunks, the RoPE sections and LongRoPE factors sized by a head's rotary size); every other field stays
# as published
SIZE_FIELDS = {
    "hidden_size", "block_dim", "conv_dim", "conv_dim_out", "intermediate_size", "intermediate_size_mlp",
    "block_ff_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim", "linear_key_head_dim",
    "linear_value_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "q_lora_rank",
    "num_heads", "linear_num_heads", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
    "linear_num_value_heads", "num_experts", "num_local_experts", "n_routed_experts", "vocab_size",
    "max_position_embeddings", "model_max_length", "sliding_window", "attention_chunk_size", "num_hidden_layers",
    "bos_token_id", "eos_token_id", "pad_token_id", "mrope_section", "short_factor", "long_factor",
}
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return story_prompt(tokenizer)


@pytest.fixture(scope="module", params=list(PUBLISHED_CACHE_KIND))
def published(request, tokenizer, prompt):
    """(name, target, a draft of it that accepts some tokens and refuses others)."""
    name = request.param
    target = Target(name, published_model(name), tokenizer)
    return name, target, mixed_draft(target, prompt)


def test_plain_decoding_is_hf_generate(published, prompt):
    name, target, _ = published
    check_plain_decoding_is_hf_generate(target, prompt)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_speculative_decoding_equals_plain_decoding(published, prompt, shape):
    name, target, draft = published
    check_speculative_decoding_is_plain(target, draft, prompt, shape, PUBLISHED_CACHE_KIND[name])


def test_hidden_state_taps_are_the_models_own(published, prompt):
    name, target, _ = published
    check_taps_are_the_models_own(target, prompt)


def test_one_training_step_of_every_kind(published, prompt, tokenizer):
    name, target, _ = published
    check_one_training_step(target, prompt, tokenizer)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_evaluator_serves_a_fresh_draft_losslessly(published, prompt, tokenizer, kind):
    name, target, _ = published
    check_the_evaluator_is_lossless(target, prompt, tokenizer, kind)


def test_plan_counts_every_weight_on_the_meta_device(published, tmp_path):
    name, target, _ = published
    saved = check_plan_counts_every_weight(target, published_config(name), tmp_path)
    assert saved["model_type"] == config_class(published_text(name)).model_type


# ------------------------------------------------------------------------------------------- the configs themselves


def field_problems(published: dict, shrunk: dict, layers: int) -> list[str]:
    """Where ``shrunk`` differs from ``published`` other than in a size: a field dropped or changed, a per-layer
    list that is not the published one's first ``layers`` entries, a head ratio or expert routing broken."""
    problems = []
    for key, value in published.items():
        if key in NOT_ARCHITECTURE:
            continue
        if key not in shrunk:
            problems.append(f"{key} dropped")
        elif isinstance(value, dict):
            problems += [f"{key}.{p}" for p in field_problems(value, shrunk[key], layers)]
        elif key in SIZE_FIELDS:
            problems += _size_problem(key, value, shrunk[key])
        elif shrunk[key] != _kept(key, value, published, layers):
            problems.append(f"{key}: {shrunk[key]!r}, published {value!r}")
    for many, few in HEAD_PAIRS:
        if many in published and published[many] * shrunk.get(few, 1) != shrunk[many] * published.get(few, 1):
            problems.append(f"{many} / {few} ratio changed")
    experts = [shrunk[k] for k in EXPERT_COUNTS if shrunk.get(k)]
    if experts and any(shrunk.get(k) and shrunk[k] > min(experts) for k in TOP_K):
        problems.append("more experts per token than experts")
    return problems


def _kept(key: str, value, published: dict, layers: int):
    """What an unchanged field looks like in a model of the first ``layers`` layers."""
    if key == "model_type":
        return config_class(published).model_type  # the published type, or (unregistered) its architecture's
    if key in LAYER_INDICES:
        return [i for i in value if i - LAYER_INDICES[key] < layers]
    if isinstance(value, list) and len(value) == published.get("num_hidden_layers"):
        return value[:layers]
    return value


def _size_problem(key: str, value, small) -> list[str]:
    if key == "vocab_size":  # the matrix's tokenizer's, smaller or larger than the published one
        return [] if small == VOCAB else [f"vocab_size: {small!r}, the tokenizer has {VOCAB}"]
    if value is None or small is None:
        return [] if value is small or key.endswith("token_id") else [f"{key}: {small!r}, published {value!r}"]
    numbers = [small] if not isinstance(small, list) else small
    published = [value] if not isinstance(value, list) else value
    return [] if key.endswith("token_id") or max(numbers) <= max(published) else [f"{key} grew: {small!r}"]


@pytest.mark.parametrize("name", list(PUBLISHED_CACHE_KIND))
def test_the_tiny_config_keeps_every_field_but_the_sizes(name):
    text, shrunk = published_text(name), shrunk_config(name)
    assert field_problems(text, shrunk, shrunk["num_hidden_layers"]) == []
    assert {*TINY_SIZES, *HIDDEN_WIDTHS} <= SIZE_FIELDS  # the builder shrinks nothing but what the matrix calls a size
    for key in ("sliding_window", "attention_chunk_size"):  # a test prompt passes every window that slides
        assert shrunk.get(key) in (None, WINDOW) or shrunk[key] >= shrunk.get("max_position_embeddings", float("inf"))


def test_a_builder_that_drops_or_changes_a_field_fails_the_check():
    text, shrunk = published_text("deepseek_v3"), shrunk_config("deepseek_v3")
    layers = shrunk["num_hidden_layers"]
    dropped = {k: v for k, v in shrunk.items() if k != "first_k_dense_replace"}
    changed = {**shrunk, "rope_scaling": {**shrunk["rope_scaling"], "factor": 4}, "num_key_value_heads": 1}
    assert field_problems(text, dropped, layers) == ["first_k_dense_replace dropped"]
    assert field_problems(text, changed, layers) == ["rope_scaling.factor: 4, published 40",
                                                     "num_attention_heads / num_key_value_heads ratio changed"]


@pytest.mark.parametrize("name", list(PUBLISHED_CACHE_KIND))
def test_the_tiny_model_has_every_kind_of_layer_the_published_one_has_in_its_order(name):
    """Attention type, RoPE or none, dense MLP or experts, per layer: the tiny model's layers are the published
    model's first ones (both built by transformers, the published one on the meta device) and show every kind."""
    full = layer_kinds(published_model_on_meta(name))
    tiny = layer_kinds(random_model_on_meta(published_config(name)))
    assert tiny == full[: len(tiny)] and set(tiny) == set(full)
    assert published_config(name).num_hidden_layers <= 6  # tiny: a test runs in seconds


def test_every_published_config_has_a_cache_kind_and_a_source():
    sources = (PUBLISHED / "SOURCES.md").read_text()
    files = {path.stem for path in PUBLISHED.glob("*.json")}
    assert files == set(PUBLISHED_CACHE_KIND)
    assert all(f"`{name}.json`" in sources for name in files)
