"""Bad input to the decoding API fails early with a DrafttrainError that names the cause."""

from __future__ import annotations

import copy

import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.decoding import (
    Chain,
    Draft,
    DynamicTree,
    Proposer,
    SpeculativeDecoder,
    StaticTree,
    build_proposer,
    plain_decode,
)
from drafttrain.targets import Target


@pytest.fixture(scope="module")
def lookup(smollm2):
    return build_proposer("prompt_lookup", smollm2)


def test_unknown_proposer_lists_the_known_ones(smollm2):
    with pytest.raises(DrafttrainError, match="unknown proposer 'eagle9'.*draft_model.*prompt_lookup"):
        build_proposer("eagle9", smollm2)
    with pytest.raises(DrafttrainError, match="unknown proposer"):
        SpeculativeDecoder(smollm2, "nope")


def test_unknown_proposer_option(smollm2):
    with pytest.raises(DrafttrainError, match="prompt_lookup.*max_ngram"):
        build_proposer("prompt_lookup", smollm2, max_ngram=3)
    with pytest.raises(DrafttrainError, match="min_ngram_size <= max_ngram_size"):
        build_proposer("prompt_lookup", smollm2, min_ngram_size=4, max_ngram_size=2)


@pytest.mark.parametrize("depth", [0, -2, 1.5, True])
def test_bad_depth(smollm2, lookup, depth):
    with pytest.raises(DrafttrainError, match="depth"):
        SpeculativeDecoder(smollm2, lookup, depth=depth)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_settings(smollm2, lookup, kwargs, match):
    with pytest.raises(DrafttrainError, match=match):
        SpeculativeDecoder(smollm2, lookup, **kwargs)
    with pytest.raises(DrafttrainError, match=match):
        plain_decode(smollm2, [1, 2, 3], 4, **kwargs)


@pytest.mark.parametrize(
    "tree,match",
    [
        ("bush", "tree='bush' is not understood"),
        ([], "at least one path"),
        ([[0], [0, 0, 1]], r"listed without its prefix \[0, 0\]"),
        ([[0], [2]], r"skips a sibling: \[1\] is missing"),
        ([[0], [-1]], "child ranks >= 0"),
    ],
)
def test_bad_tree(smollm2, lookup, tree, match):
    with pytest.raises(DrafttrainError, match=match):
        SpeculativeDecoder(smollm2, lookup, tree=tree)


def test_bad_dynamic_tree():
    with pytest.raises(DrafttrainError, match="DynamicTree.total_tokens must be a positive integer"):
        DynamicTree(total_tokens=0)
    with pytest.raises(DrafttrainError, match="DynamicTree.top_k"):
        DynamicTree(top_k=-3)


def test_static_tree_accepts_unordered_paths():
    tree = StaticTree([[1, 0], [0], [1], [0, 0], [0]])
    assert tree.paths == [[0], [1], [0, 0], [1, 0]]
    assert tree.parents == [-1, -1, 0, 1] and tree.depth == 2


@pytest.mark.parametrize("prompt", [[], torch.empty(0, dtype=torch.long), torch.empty(1, 0, dtype=torch.long)])
def test_empty_prompt(smollm2, lookup, prompt):
    with pytest.raises(DrafttrainError, match="prompt is empty"):
        SpeculativeDecoder(smollm2, lookup).generate(prompt, 4)
    with pytest.raises(DrafttrainError, match="prompt is empty"):
        plain_decode(smollm2, prompt, 4)


def test_batched_or_non_token_prompt(smollm2, lookup):
    decoder = SpeculativeDecoder(smollm2, lookup)
    with pytest.raises(DrafttrainError, match="one sequence"):
        decoder.generate(torch.ones(2, 5, dtype=torch.long), 4)
    with pytest.raises(DrafttrainError, match="token ids"):
        decoder.generate("hello", 4)
    with pytest.raises(DrafttrainError, match="max_new_tokens"):
        decoder.generate([1, 2, 3], -1)
    assert decoder.generate([1, 2, 3], 0).tokens == []


def test_draft_model_needs_a_draft(smollm2):
    with pytest.raises(DrafttrainError, match="needs draft="):
        build_proposer("draft_model", smollm2)
    with pytest.raises(DrafttrainError, match="needs draft="):
        build_proposer("draft_model", smollm2, draft="")
    with pytest.raises(DrafttrainError, match="/no/such/draft"):
        build_proposer("draft_model", smollm2, draft="/no/such/draft")


def _other(smollm2, name: str, edit) -> Target:
    tokenizer = copy.deepcopy(smollm2.tokenizer)
    edit(tokenizer)
    return Target(name=name, model=smollm2.model, tokenizer=tokenizer)


def test_draft_with_a_different_vocabulary_is_refused(smollm2):
    draft = _other(smollm2, "bigger-vocab-draft", lambda t: t.add_tokens(["<drafttrain-extra-token>"]))
    match = "bigger-vocab-draft.*smollm2-135m-instruct.*vocabularies differ.*1 only in the draft"
    with pytest.raises(DrafttrainError, match=match):
        build_proposer("draft_model", smollm2, draft=draft)


def test_draft_with_different_special_tokens_is_refused(smollm2):
    def swap_eos(tokenizer):
        tokenizer.eos_token = "<|im_start|>"

    draft = _other(smollm2, "other-eos-draft", swap_eos)
    with pytest.raises(DrafttrainError, match="other-eos-draft.*smollm2-135m-instruct.*eos_token_id"):
        build_proposer("draft_model", smollm2, draft=draft)


def test_proposer_that_cannot_fill_the_shape(smollm2):
    class ChainOnly(Proposer):
        name = "chain_only"
        shapes = (Chain,)

        def prefill(self, input_ids, hidden, next_token): ...

        def propose(self, request):
            return Draft.empty()

        def accept(self, tokens, hidden): ...

    with pytest.raises(DrafttrainError, match="'chain_only' cannot fill a DynamicTree draft.*Chain"):
        SpeculativeDecoder(smollm2, ChainOnly(), tree=DynamicTree())
    SpeculativeDecoder(smollm2, ChainOnly(), depth=2)  # a chain is fine


def test_malformed_draft_is_a_programming_error():
    with pytest.raises(ValueError, match="parents must precede"):
        Draft(torch.tensor([[1, 2]]), [1, -1])
    with pytest.raises(ValueError, match="do not match"):
        Draft(torch.tensor([[1, 2, 3]]), [-1, 0])
