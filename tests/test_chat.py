"""The one prompt and stop-token rule: regeneration, tokenisation and evaluation render prompts the same way and
stop answers at the same tokens, for every bundled chat template."""

from __future__ import annotations

import pytest
import torch
from conftest import template_variant

from drafttrain.config import RegenerateConfig
from drafttrain.data.chat import end_of_turn_ids, eos_token_ids, prompt_ids, stop_token_ids
from drafttrain.data.regenerate import HFGenerator, RegenerationSettings
from drafttrain.data.tokenize import tokenize_conversation
from drafttrain.evaluation import evaluate
from drafttrain.targets import Target

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
# template file (None: SmolLM2's own), control tokens to add, bos, the end-of-turn token the template writes
TEMPLATES = {
    "smollm2": (None, [], None, "<|im_end|>"),
    "llama3.1": ("llama3.1_instruct.jinja", LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": ("qwen2.5_instruct.jinja", ["<tool_call>", "</tool_call>"], None, "<|im_end|>"),
    "qwen3": ("qwen3.jinja", ["<think>", "</think>"], None, "<|im_end|>"),
    "gemma2": ("gemma2_it.jinja", ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from drafttrain.targets import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def tokenizer_for(smol_tokenizer, name):
    template, specials, bos, _ = TEMPLATES[name]
    return smol_tokenizer if template is None else template_variant(smol_tokenizer, template, specials, bos)


def tiny_target_with(tokenizer) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    return Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), tokenizer)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_regeneration_and_evaluation_stop_at_the_same_tokens(smol_tokenizer, name):
    tokenizer = tokenizer_for(smol_tokenizer, name)
    end_of_turn = tokenizer.convert_tokens_to_ids(TEMPLATES[name][3])
    assert end_of_turn_ids(tokenizer) == [end_of_turn]

    target = tiny_target_with(tokenizer)
    settings = RegenerationSettings.from_config(RegenerateConfig(max_new_tokens=2), "tiny", 0, tokenizer)
    regeneration = HFGenerator(target.model, tokenizer, settings).stop_ids
    report = evaluate(target, "prompt_lookup", ["Hi"], max_new_tokens=2, progress=False, warmup=False)
    assert report.config["stop_token_ids"] == regeneration
    assert end_of_turn in regeneration
    assert set(regeneration) == {end_of_turn, *eos_token_ids(tokenizer, target.model.generation_config)}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_trained_answer_ends_with_a_stop_token(smol_tokenizer, name):
    """What tokenisation trains the head to produce at the end of an answer is a token the engines stop at."""
    tokenizer = tokenizer_for(smol_tokenizer, name)
    row = tokenize_conversation(tokenizer, {"id": "c", "source": "s", "needs_response": False, "messages": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]}, max_length=256)
    last_trained = max(i for i, m in enumerate(row["loss_mask"]) if m)
    assert row["input_ids"][last_trained] in stop_token_ids(tokenizer)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_prompts_are_rendered_as_training_renders_them(smol_tokenizer, name):
    """The prompt the target answers is, as text, exactly the training row up to the trained answer. (As tokens
    the last one may differ: BPE can merge the template's header with the answer's first characters.)"""
    tokenizer = tokenizer_for(smol_tokenizer, name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    row = tokenize_conversation(tokenizer, {"id": "c", "source": "s", "needs_response": False, "messages": [
        *messages, {"role": "assistant", "content": "Four."}]}, max_length=256)
    prompt = tokenizer.decode(prompt_ids(tokenizer, messages))
    full = tokenizer.decode(row["input_ids"])
    assert full.startswith(prompt)
    answer = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert full[len(prompt):].lstrip().startswith(answer.lstrip()[:4])
