"""The target-family matrix: every decoder-only family people serve (tests/families.py), each as a tiny random
model from transformers' own classes, through what drafttrain does with a target: hidden-state taps, one training
step of every draft kind, speculative decoding (chains, static and dynamic trees) equal token for token to plain
decoding and to HF generate at T=0, the evaluator with trained-kind proposers, and plan's sizes.

Each family's windows (8 tokens), chunks (8) and linear or SSM layers are passed by the test's prompt, and the
noised draft both accepts and refuses tokens, so every rollback kind is exercised past its window or state."""

from __future__ import annotations

import pytest
import torch
from families import (
    CACHE_KIND,
    FAMILIES,
    MOE_FAMILIES,
    SHAPES,
    check_one_training_step,
    check_plain_decoding_is_hf_generate,
    check_plan_counts_every_weight,
    check_speculative_decoding_is_plain,
    check_taps_are_the_models_own,
    check_the_evaluator_is_lossless,
    family_config,
    family_model,
    mixed_draft,
    story_prompt,
)

from drafttrain.targets import Target, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return story_prompt(tokenizer)  # the prompt alone passes every window and chunk


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokenizer, prompt):
    """(name, target, a draft of it that accepts some tokens and refuses others)."""
    name = request.param
    target = Target(name, family_model(name), tokenizer)
    return name, target, mixed_draft(target, prompt)


def test_plain_decoding_is_hf_generate(family, prompt):
    name, target, _ = family
    check_plain_decoding_is_hf_generate(target, prompt)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_speculative_decoding_equals_plain_decoding(family, prompt, shape):
    """Past every window and chunk, and past refused drafts: the cache rolled back exactly (targets.cache)."""
    name, target, draft = family
    check_speculative_decoding_is_plain(target, draft, prompt, shape, CACHE_KIND[name])


def test_hidden_state_taps_are_the_models_own(family, prompt):
    name, target, _ = family
    check_taps_are_the_models_own(target, prompt)


def test_one_training_step_of_every_kind(family, prompt, tokenizer):
    name, target, _ = family
    check_one_training_step(target, prompt, tokenizer)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_evaluator_serves_a_fresh_draft_losslessly(family, prompt, tokenizer, kind):
    """The kind's own proposer (the target's taps read while it decodes) against plain decoding in one run."""
    name, target, _ = family
    check_the_evaluator_is_lossless(target, prompt, tokenizer, kind)


def test_plan_counts_every_weight_on_the_meta_device(family, tmp_path):
    """plan builds the target on the meta device from its config alone: every expert's weights counted."""
    name, target, _ = family
    assert check_plan_counts_every_weight(target, family_config(name), tmp_path)["model_type"] == FAMILIES[name][0]


def test_the_matrix_covers_every_family_the_readme_names():
    assert len(FAMILIES) == 22 and set(CACHE_KIND) == set(FAMILIES)
    assert set(MOE_FAMILIES) <= set(FAMILIES)
    for name in MOE_FAMILIES:
        config = family_config(name)
        experts = [getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")]
        assert any(e and e > 1 for e in experts), name


RECURRENT = [name for name, kind in CACHE_KIND.items() if kind == "recurrent"]


def _next_logits(cache, token: int) -> torch.Tensor:
    return cache.forward(torch.tensor([[token]]))[0, -1]


@pytest.mark.parametrize("name", RECURRENT)
def test_a_recurrent_rollback_takes_the_recorded_state_and_runs_nothing_again(name, prompt, tokenizer):
    """A verification's refused tokens dropped from a recurrent target: the states recorded during that forward are
    taken back (no forward runs in the rollback), and the cache is then what feeding the kept tokens alone gives.
    transformers before 5.25 records no states (pyproject's floor, 5.24): there the rollback replays the kept tokens
    in one forward, to the same cache."""
    import transformers
    from packaging.version import Version

    from drafttrain.targets import TargetCache

    records = Version(transformers.__version__) >= Version("5.25")

    model = family_model(name)
    fed = torch.tensor([[11, 12, 13, 14, 15]])
    with torch.no_grad():
        cache = TargetCache(model)
        cache.forward(torch.tensor([prompt]))
        cache.forward(fed)  # a verification: root + 4 draft tokens
        calls = []
        hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
        cache.keep(len(prompt), [0, 1])  # root and one draft token kept, three refused
        hook.remove()
        assert calls == ([] if records else [1]) and cache.length == len(prompt) + 2
        rolled = _next_logits(cache, 99)
        fresh = TargetCache(model)
        fresh.forward(torch.tensor([prompt]))
        fresh.forward(fed[:, :2])
        # float32 noise of the two feeds' shapes only (in float64 the logits are equal, bit for bit)
        torch.testing.assert_close(rolled, _next_logits(fresh, 99), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_rollback_past_the_recorded_states_restores_and_replays_exactly(name, prompt):
    """Dropping further back than any forward recorded (here into the prompt, fed in one long forward): the states
    copied before that forward are restored and the kept tokens fed again, as before recording existed."""
    from drafttrain.targets import TargetCache

    model = family_model(name)
    with torch.no_grad():
        cache = TargetCache(model)
        cache.forward(torch.tensor([prompt * 3]))  # longer than a recorded forward may be: run chunked
        assert cache.recorded < 3
        calls = []
        hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
        cache.keep(len(prompt), [])
        hook.remove()
        assert len(calls) == 1 and cache.length == len(prompt)  # one replay of the kept prompt
        fresh = TargetCache(model)
        fresh.forward(torch.tensor([prompt]))
        torch.testing.assert_close(_next_logits(cache, 99), _next_logits(fresh, 99), atol=1e-5, rtol=1e-4)
