"""Speculative decoding on the real SmolLM2 target: greedy outputs must be token-for-token the target's own greedy
output (plain_decode and HF generate), for chains, static and dynamic trees, prompt lookup and draft models; the
KV cache and the hidden states handed to proposers must match a fresh forward over the emitted text."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from drafttrain.decoding import (
    DynamicTree,
    Proposer,
    SpeculativeDecoder,
    build_proposer,
    plain_decode,
)
from drafttrain.decoding.trees import ancestor_matrix, tree_position_ids
from drafttrain.targets import HiddenStateTap, Target, TargetCache
from drafttrain.targets.masks import cache_argument

pytestmark = pytest.mark.slow

NEW = 40  # new tokens per greedy comparison
STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
SMALL_DYNAMIC = DynamicTree(total_tokens=16, depth=4, top_k=4)
PROMPTS = {"travel": 81, "edit": 90}  # a free-form answer, and one that copies the prompt (prompt lookup hits)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The CI box has 2 cores shared by several jobs: two spinning intra-op threads per process are 3-8x slower
    than one there. Both sides of every comparison run under the same setting."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def prompts(smollm2, repo_data) -> dict[str, list[int]]:
    rows = {json.loads(line)["question_id"]: json.loads(line) for line in open(repo_data / "eval" / "mt_bench.jsonl")}
    out = {}
    for name, qid in PROMPTS.items():
        messages = [{"role": "user", "content": rows[qid]["turns"][0]}]
        rendered = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out[name] = list(rendered["input_ids"])
    return out


@pytest.fixture(scope="module")
def reference(smollm2, prompts) -> dict[str, list[int]]:
    return {name: plain_decode(smollm2, ids, NEW).tokens for name, ids in prompts.items()}


@pytest.fixture(scope="module")
def noisy_draft(smollm2) -> Target:
    """SmolLM2 with Gaussian noise (10% of each matrix's std) on its decoder weights: accepts some, rejects some."""
    model = copy.deepcopy(smollm2.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.model.layers.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=g) * 0.1 * param.std())
    return Target(name="smollm2-noised", model=model, tokenizer=smollm2.tokenizer)


def run(target, proposer, ids, new=NEW, **kwargs):
    decoder = SpeculativeDecoder(target, proposer, **kwargs)
    return decoder, decoder.generate(ids, new)


def check_stats(out, decoder, prompt_len: int) -> None:
    s = out.stats
    assert s.new_tokens == len(out.tokens)
    assert s.target_forwards == len(s.accepted_per_step) == len(s.drafted_per_step)
    assert all(0 <= a <= d for a, d in zip(s.accepted_per_step, s.drafted_per_step))
    assert s.new_tokens <= 1 + sum(a + 1 for a in s.accepted_per_step)
    assert sum(s.position_accepted) == sum(s.accepted_per_step)
    assert s.position_drafted[:1] == [sum(d > 0 for d in s.drafted_per_step)] or not s.position_drafted
    assert s.wall_time_s >= s.prefill_time_s + s.verify_time_s
    assert decoder.cache.length == prompt_len + s.new_tokens - 1  # the cache invariant


# -------------------------------------------------------------------------------------------------- baseline


@pytest.mark.parametrize("name", list(PROMPTS))
def test_plain_decode_matches_hf_generate(smollm2, prompts, reference, name):
    ids = torch.tensor([prompts[name]])
    # the chat template contains <|im_end|> (= pad id): pass the mask, or HF would treat those as padding
    hf = smollm2.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
        temperature=None, top_p=None, top_k=None, eos_token_id=None, pad_token_id=smollm2.tokenizer.pad_token_id,
    )
    assert hf[0, ids.shape[1]:].tolist() == reference[name]
    out = plain_decode(smollm2, prompts[name], 8)
    assert out.stats.target_forwards == 7 and out.stats.accepted_per_step == [0] * 7


# ------------------------------------------------------------------------------------------------ proposers

PL_CASES = [
    pytest.param("edit", dict(depth=1), id="edit-k1"),
    pytest.param("edit", dict(depth=3), id="edit-k3"),
    pytest.param("edit", dict(depth=6), id="edit-k6"),
    pytest.param("travel", dict(depth=3), id="travel-k3"),
    pytest.param("edit", dict(tree=STATIC_TREE), id="edit-static"),
    pytest.param("edit", dict(tree=SMALL_DYNAMIC), id="edit-dynamic"),
]


@pytest.mark.parametrize("name,kwargs", PL_CASES)
def test_prompt_lookup_is_greedy_exact(smollm2, prompts, reference, name, kwargs):
    decoder, out = run(smollm2, build_proposer("prompt_lookup", smollm2), prompts[name], **kwargs)
    assert out.tokens == reference[name]
    check_stats(out, decoder, len(prompts[name]))
    if name == "edit":
        assert sum(out.stats.accepted_per_step) > 0  # the answer copies the prompt: lookups must be accepted


NOISY_CASES = [
    pytest.param("travel", dict(depth=1), id="travel-k1"),
    pytest.param("travel", dict(depth=3), id="travel-k3"),
    pytest.param("edit", dict(depth=6), id="edit-k6"),
    pytest.param("travel", dict(tree=STATIC_TREE), id="travel-static"),
    pytest.param("travel", dict(tree=SMALL_DYNAMIC), id="travel-dynamic"),
    pytest.param("edit", dict(tree=SMALL_DYNAMIC), id="edit-dynamic"),
]


@pytest.mark.parametrize("name,kwargs", NOISY_CASES)
def test_noisy_draft_model_is_greedy_exact(smollm2, noisy_draft, prompts, reference, name, kwargs):
    proposer = build_proposer("draft_model", smollm2, draft=noisy_draft)
    decoder, out = run(smollm2, proposer, prompts[name], new=32, **kwargs)
    assert out.tokens == reference[name][:32]
    check_stats(out, decoder, len(prompts[name]))
    accepted, drafted = out.stats.accepted_per_step, out.stats.drafted_per_step
    assert 0 < sum(accepted) < sum(drafted)  # real acceptances and real rejections


@pytest.mark.parametrize(
    "kwargs", [dict(depth=4), dict(tree=STATIC_TREE), dict(tree=SMALL_DYNAMIC)], ids=["chain", "static", "dynamic"]
)
def test_target_as_its_own_draft_accepts_everything(smollm2, prompts, reference, kwargs):
    proposer = build_proposer("draft_model", smollm2, draft=smollm2)
    decoder, out = run(smollm2, proposer, prompts["travel"], new=24, **kwargs)
    assert out.tokens == reference["travel"][:24]
    check_stats(out, decoder, len(prompts["travel"]))
    accepted, drafted = out.stats.accepted_per_step, out.stats.drafted_per_step
    if "tree" in kwargs and isinstance(kwargs["tree"], DynamicTree):
        # EAGLE-2 keeps the best *cumulative* scores: the greedy path may leave the tree before its deepest node
        assert min(accepted) >= 1 and sum(accepted) > 0.6 * sum(drafted)
    else:  # every step but a truncated last one accepts the full depth
        assert accepted[:-1] == drafted[:-1]


# ------------------------------------------------------------------------------------------ tree attention


def test_tree_forward_equals_each_path_run_separately(smollm2, prompts):
    """One forward over a tree with the 4D ancestor mask gives, for every node, the logits of running its
    root-to-node path as a plain sequence; without the mask (causal) it does not: the mask is really used."""
    model, ids = smollm2.model, torch.tensor([prompts["travel"]])
    parents = [-1, -1, 0, 0, 1, 2, 4]
    tokens = ids[:, 5 : 5 + 8]  # root + 7 nodes: any tokens will do
    with torch.inference_mode():
        cache = TargetCache(model)
        cache.forward(ids)
        prefix = cache.length
        pos = tree_position_ids(parents, prefix, ids.device)
        tree = cache.forward(tokens, position_ids=pos, allowed=ancestor_matrix(tuple(parents)))[0]
        cache.keep(prefix, [])
        causal = cache.forward(tokens, position_ids=pos)[0]
        cache.keep(prefix, [])
        for node in range(-1, len(parents)):
            path, n = [], node
            while n >= 0:
                path.insert(0, n + 1)
                n = parents[n]
            seq = tokens[:, [0] + path]
            alone = cache.forward(seq)[0, -1]
            cache.keep(prefix, [])
            torch.testing.assert_close(tree[node + 1], alone, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(causal[2], tree[2], atol=1e-2)  # node 1 would otherwise see node 0


def test_the_cache_goes_under_the_name_the_models_forward_takes(smollm2, prompts):
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40):
    the one forward path passes the cache under the name the model takes, so no deprecation warning is raised, and
    the cache still fills (through the causal LM and through its decoder with a draft-vocabulary head). A forward
    that knows only the old name (transformers 5.0) gets the old name."""
    model, ids = smollm2.model, torch.tensor([prompts["travel"][:12]])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = TargetCache(model)
        cache.forward(ids)
        cache.forward(ids[:, :3], logits_to_keep=1, head=model.lm_head)
    assert cache.length == 15 and cache.cache.get_seq_length() == 15

    class OldName(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    assert cache_argument(OldName) == "past_key_values"


# ------------------------------------------------------------------------------------------- cache & hidden


def fresh_cache_and_hidden(model, ids: list[int], layers: list[int]):
    with torch.inference_mode(), HiddenStateTap(model, layers) as tap:
        cache = TargetCache(model)
        cache.forward(torch.tensor([ids]))
        return cache, tap.stacked()


def assert_cache_matches(cache, fresh) -> None:
    assert cache.length == fresh.length
    for ours, ref in zip(cache.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, ref.keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=2e-4, rtol=1e-4)


class RecordingProposer(Proposer):
    """Wraps a proposer and records the hidden states the engine hands over (what an EAGLE head would get)."""

    hidden_layers = [2, 15, -1]

    def __init__(self, inner):
        self.inner, self.name = inner, "recording"

    def prefill(self, input_ids, hidden, next_token):
        self.hidden, self.tokens = [hidden], [next_token]
        self.inner.prefill(input_ids, None, next_token)

    def propose(self, request):
        return self.inner.propose(request)

    def accept(self, tokens, hidden):
        assert hidden.shape[:2] == tokens.shape
        self.hidden.append(hidden)
        self.tokens.append(tokens)
        self.inner.accept(tokens, None)


@pytest.mark.parametrize("kwargs", [dict(depth=3), dict(tree=SMALL_DYNAMIC)], ids=["chain", "dynamic"])
def test_cache_and_hidden_states_match_a_fresh_forward(smollm2, noisy_draft, prompts, reference, kwargs):
    ids = prompts["travel"]
    proposer = RecordingProposer(build_proposer("draft_model", smollm2, draft=noisy_draft))
    decoder, out = run(smollm2, proposer, ids, new=16, **kwargs)
    assert out.tokens == reference["travel"][:16]
    text = ids + out.tokens[:-1]  # what the cache must hold: everything but the last emitted token
    fresh, hidden = fresh_cache_and_hidden(smollm2.model, text, [2, 15, smollm2.num_layers])
    assert_cache_matches(decoder.cache, fresh)
    got = torch.cat(proposer.hidden, dim=1)
    assert got.shape[2] == 3 * smollm2.hidden_size and got.shape[1] >= len(text)
    torch.testing.assert_close(got[:, : len(text)], hidden, atol=2e-3, rtol=1e-3)
    # tokens pair with hidden states: position i's state comes with the token at i + 1
    assert torch.cat(proposer.tokens, dim=1)[0, : len(out.tokens)].tolist() == out.tokens


def test_truncated_step_and_stop_token_keep_the_cache_consistent(smollm2, prompts, reference):
    ids = prompts["edit"]
    ref = reference["edit"]
    # max_new_tokens ends inside an accepted run of the self-draft: the surplus must be cropped
    decoder, out = run(smollm2, build_proposer("draft_model", smollm2, draft=smollm2), ids, new=6, depth=6)
    assert out.tokens == ref[:6] and out.stats.target_forwards == 1
    assert_cache_matches(decoder.cache, fresh_cache_and_hidden(smollm2.model, ids + ref[:5], [2])[0])
    # a stop token inside an accepted run ends generation right after it
    stop = ref[10]
    first = ref.index(stop)
    decoder = SpeculativeDecoder(smollm2, build_proposer("prompt_lookup", smollm2), depth=6)
    out = decoder.generate(ids, NEW, stop_token_ids={stop})
    assert out.tokens == ref[: first + 1]
    assert decoder.cache.length == len(ids) + first


# ------------------------------------------------------------------------------------------ sampling smoke


@pytest.mark.parametrize(
    "kwargs", [dict(depth=3), dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])], ids=["chain", "static"]
)
def test_sampling_with_itself_as_draft_accepts_nearly_everything(smollm2, prompts, kwargs):
    """q == p up to rounding, so min(1, p/q) ~ 1: a misaligned q or p row would show up as rejections."""
    proposer = build_proposer("draft_model", smollm2, draft=smollm2)
    decoder, out = run(smollm2, proposer, prompts["travel"], new=16, temperature=1.0, top_p=0.95, seed=3, **kwargs)
    check_stats(out, decoder, len(prompts["travel"]))
    s = out.stats
    assert sum(s.accepted_per_step[:-1]) >= 0.9 * sum(s.drafted_per_step[:-1])
    again = SpeculativeDecoder(smollm2, build_proposer("draft_model", smollm2, draft=smollm2), temperature=1.0,
                               top_p=0.95, seed=3, **kwargs).generate(prompts["travel"], 16)
    assert again.tokens == out.tokens  # seeded


def test_sampling_prompt_lookup_tree_runs(smollm2, prompts):
    decoder, out = run(smollm2, build_proposer("prompt_lookup", smollm2), prompts["edit"], new=16,
                       tree=SMALL_DYNAMIC, temperature=0.7, top_k=40, seed=0)
    check_stats(out, decoder, len(prompts["edit"]))
    assert len(out.tokens) == 16 and all(0 <= t < smollm2.vocab_size for t in out.tokens)
