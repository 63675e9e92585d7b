"""The target-family matrix: every decoder-only family people serve (tests/families.py), each as a tiny random
model from transformers' own classes, through what drafttrain does with a target: hidden-state taps, one training
step of every draft kind, speculative decoding (chains, static and dynamic trees) equal token for token to plain
decoding and to HF generate at T=0, the evaluator with trained-kind proposers, and plan's sizes.

Each family's windows (8 tokens), chunks (8) and linear or SSM layers are passed by the test's prompt, and the
noised draft both accepts and refuses tokens, so every rollback kind is exercised past its window or state."""

from __future__ import annotations

import json

import pytest
import torch
from families import CACHE_KIND, FAMILIES, MOE_FAMILIES, WINDOW, family_config, family_model, noised

from drafttrain import DrafttrainError
from drafttrain.config import parse_recipe
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.decoding.trees import DynamicTree
from drafttrain.drafts import build_drafter
from drafttrain.evaluation.evaluate import evaluate
from drafttrain.targets import Target, TargetNeeds, load_tokenizer, run_target
from drafttrain.training.plan import plan

NEW = 40
SHAPES = {"chain": dict(depth=3), "static_tree": dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
          "dynamic_tree": dict(tree=DynamicTree(total_tokens=8, depth=3, top_k=3))}
TREES_REFUSED = {"recurrent", "conv"}  # one forward cannot verify branches through layers that run tokens in order
KINDS = {"eagle3": {"kind": "eagle3"}, "eagle": {"kind": "eagle"}, "medusa": {"kind": "medusa"},
         "peagle": {"kind": "eagle3", "parallel": {"depths": 3}}, "dflash": {"kind": "dflash"},
         "draft_model": {"kind": "draft_model", "cut": "first:2"},
         "pard": {"kind": "draft_model", "cut": "first:2", "parallel": {"depths": 3}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Tell me a long story about a cat and a dog."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert len(ids) > 3 * WINDOW  # the prompt alone passes every window and chunk
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


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokenizer, prompt):
    """(name, target, a draft of it that accepts some tokens and refuses others)."""
    name = request.param
    target = Target(name, family_model(name), tokenizer)
    return name, target, mixed_draft(target, prompt)


def test_plain_decoding_is_hf_generate(family, prompt):
    name, target, _ = family
    ours = plain_decode(target, prompt, NEW).tokens
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == hf


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_speculative_decoding_equals_plain_decoding(family, prompt, shape):
    """Past every window and chunk, and past refused drafts: the cache rolled back exactly (targets.cache)."""
    name, target, draft = family
    reference = plain_decode(target, prompt, NEW).tokens
    proposer = build_proposer("draft_model", target, draft=draft)
    if shape != "chain" and CACHE_KIND[name] in TREES_REFUSED:
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


def test_hidden_state_taps_are_the_models_own(family, prompt):
    name, target, _ = family
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


def test_one_training_step_of_every_kind(family, prompt, tokenizer):
    name, target, _ = family
    answer = tokenizer("Once upon a time a cat met a dog in a big green garden.")["input_ids"]
    ids = torch.tensor([prompt + answer])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, len(prompt):] = 1
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    for kind, section in KINDS.items():
        torch.manual_seed(0)
        drafter = build_drafter(parse_recipe({"draft": section}).draft, target).train()
        result = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
        result.loss.backward()
        trained = [p for p in drafter.parameters() if p.requires_grad]
        assert torch.isfinite(result.loss), kind
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained), kind
        assert not any(p.grad is not None for p in target.model.parameters()), kind  # the target stays frozen


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_evaluator_serves_a_fresh_draft_losslessly(family, prompt, tokenizer, kind):
    """The kind's own proposer (the target's taps read while it decodes) against plain decoding in one run."""
    name, target, _ = family
    torch.manual_seed(0)
    drafter = build_drafter(parse_recipe({"draft": KINDS[kind]}).draft, target).eval()
    text = tokenizer.decode(prompt)
    report = evaluate(target, drafter, [text], depth=3, max_new_tokens=24, progress=False, warmup=False)
    assert report.overall["greedy_match"] == 1.0


def test_plan_counts_every_weight_on_the_meta_device(family, tmp_path):
    """plan builds the target on the meta device from its config alone: every expert's weights counted."""
    name, target, _ = family
    family_config(name).save_pretrained(tmp_path)
    recipe = parse_recipe({"target": {"model": str(tmp_path)}, "draft": {"kind": "eagle3"},
                           "wandb": {"mode": "disabled"}})
    result = plan(recipe, stage="train", config_path=str(tmp_path))
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    assert result.memory["target weights"] == weights
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == FAMILIES[name][0]


def test_the_matrix_covers_every_family_the_readme_names():
    assert len(FAMILIES) == 22 and set(CACHE_KIND) == set(FAMILIES)
    assert set(MOE_FAMILIES) <= set(FAMILIES)
    for name in MOE_FAMILIES:
        config = family_config(name)
        experts = [getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")]
        assert any(e and e > 1 for e in experts), name
