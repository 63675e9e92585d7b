"""Losslessness of the sampling verification rules, tested statistically on tiny vocabularies.

The "models" are first-order Markov probability tables: p(next | prev) for the target, q(next | prev) for the
draft. Drafts are drawn from q (chains: ancestral sampling; trees: children without replacement), verified by
drafttrain.decoding.verify, and the first two emitted tokens are compared with the target's exact joint
distribution p(a | x0) p(b | a) by a chi-squared test. The same harness must reject deliberately broken rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from drafttrain.decoding import verify
from drafttrain.decoding.trees import Chain, children_lists
from drafttrain.decoding.verify import (
    expected_acceptance_rate,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from drafttrain.sampling import Sampling, probabilities, sample_without_replacement

V = 6
X0 = 0  # the context token both tables condition on first
P_THRESHOLD = 1e-3  # a correct rule must not be rejected at this level
BROKEN_THRESHOLD = 1e-8  # a broken rule must be rejected far below it


def markov(seed: int) -> torch.Tensor:
    """A random row-stochastic table [V, V] (rows ~ Dirichlet(1): normalised Exp(1) draws)."""
    e = -torch.log(torch.rand(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return e / e.sum(-1, keepdim=True)


def disjoint_tables() -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.zeros(V, V, dtype=torch.float64)
    q = torch.zeros(V, V, dtype=torch.float64)
    p[:, :3] = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q[:, 3:] = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    return p, q


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    p = markov(1)
    return {
        "random": (p, markov(2)),
        "q_equals_p": (p, p.clone()),
        "disjoint": disjoint_tables(),
    }


def joint_target(p: torch.Tensor) -> np.ndarray:
    """Exact P(first = a, second = b) = p(a | x0) p(b | a)."""
    return (p[X0][:, None] * p).numpy()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel(), probs.ravel()
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:  # a token with target probability 0 was emitted
        return 0.0
    expected = probs[support] * n
    return float(scipy_stats.chisquare(counts[support], expected * counts[support].sum() / expected.sum()).pvalue)


# ---------------------------------------------------------------------------------------------- chain harness


def draw_chain(q: torch.Tensor, ctx: torch.Tensor, k: int, g, deterministic: bool):
    """Draft k tokens per row from context tokens ctx [B]: ancestral sampling from q, or q's argmax chain."""
    tokens, qs, prev = [], [], ctx
    for _ in range(k):
        rows = q[prev]
        nxt = rows.argmax(-1) if deterministic else torch.multinomial(rows, 1, generator=g)[:, 0]
        tokens.append(nxt)
        qs.append(rows)
        prev = nxt
    return torch.stack(tokens, 1), torch.stack(qs, 1)


def chain_round(p, q, ctx, k, g, deterministic):
    """One speculative step for every row: returns (accepted [B], next [B], draft [B, k])."""
    draft, q_rows = draw_chain(q, ctx, k, g, deterministic)
    p_rows = p[torch.cat([ctx[:, None], draft], 1)]  # [B, k+1, V]
    accepted, nxt = verify_chain(draft, p_rows, None if deterministic else q_rows, g)
    return accepted, nxt, draft


def chain_first_two(p, q, n, k=2, seed=0, deterministic=False) -> np.ndarray:
    """Counts [V, V] of the first two emitted tokens over n independent generations (vectorised)."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.full((n,), X0, dtype=torch.long)
    accepted, nxt, draft = chain_round(p, q, ctx, k, g, deterministic)
    emitted = torch.cat([draft, torch.zeros(n, 1, dtype=torch.long)], 1)
    emitted[torch.arange(n), accepted] = nxt  # row: accepted draft tokens, then next
    first, second = emitted[:, 0].clone(), emitted[:, 1].clone()
    again = accepted == 0  # only one token emitted: the second comes from the next step
    if again.any():
        a2, n2, d2 = chain_round(p, q, first[again], k, g, deterministic)
        second[again] = torch.where(a2 > 0, d2[:, 0], n2)
    counts = np.zeros((V, V), dtype=np.int64)
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    return counts


# ----------------------------------------------------------------------------------------------- tree harness

# root -> 3 candidates; the first has 2 children (one of them with a child), the second 1; depth 3
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 3]


def draw_trees(q: torch.Tensor, x0: torch.Tensor, g, deterministic: bool):
    """For each context token x0 [B], fill TREE_PARENTS: every node's children are drawn from q(. | node)
    without replacement (or are its top-m). Returns tokens [B, N] and q_rows [B, N+1, V]."""
    kids = children_lists(tuple(TREE_PARENTS))
    batch, n = x0.shape[0], len(TREE_PARENTS)
    tokens = torch.zeros(batch, n, dtype=torch.long)
    q_rows = torch.zeros(batch, n + 1, V, dtype=torch.float64)
    for node in range(-1, n):
        if not kids[node + 1]:
            continue
        rows = q[x0 if node < 0 else tokens[:, node]]
        m = len(kids[node + 1])
        cand = torch.topk(rows, m).indices if deterministic else sample_without_replacement(rows, m, g)
        tokens[:, list(kids[node + 1])] = cand
        q_rows[:, node + 1] = rows
    return tokens, q_rows


def tree_rounds(p, q, x0: torch.Tensor, g, deterministic) -> list[list[int]]:
    """One speculative step per context token in x0 [B]: the emitted tokens of each."""
    tokens, q_rows = draw_trees(q, x0, g, deterministic)
    p_rows = p[torch.cat([x0[:, None], tokens], 1)]
    out = []
    for b in range(x0.shape[0]):
        path, nxt = verify_tree(tokens[b], TREE_PARENTS, p_rows[b], None if deterministic else q_rows[b], g)
        out.append(tokens[b, path].tolist() + [nxt])
    return out


def tree_first_two(p, q, n, seed=0, deterministic=False) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    outs = tree_rounds(p, q, torch.full((n,), X0, dtype=torch.long), g, deterministic)
    short = [i for i, o in enumerate(outs) if len(o) == 1]  # the second token comes from a second step
    if short:
        more = tree_rounds(p, q, torch.tensor([outs[i][0] for i in short]), g, deterministic)
        for i, o in zip(short, more):
            outs[i] = outs[i] + o
    counts = np.zeros((V, V), dtype=np.int64)
    for o in outs:
        counts[o[0], o[1]] += 1
    return counts


N_CHAIN = 30_000
N_TREE = 8_000


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", ["random", "q_equals_p", "disjoint"])
@pytest.mark.parametrize("k", [1, 3])
def test_chain_emits_target_distribution(case, k):
    p, q = cases()[case]
    counts = chain_first_two(p, q, N_CHAIN, k=k, seed=11 + k)
    assert chi2_pvalue(counts, joint_target(p)) > P_THRESHOLD


def test_chain_deterministic_draft_emits_target_distribution():
    p, q = cases()["random"]
    counts = chain_first_two(p, q, N_CHAIN, k=3, seed=5, deterministic=True)
    assert chi2_pvalue(counts, joint_target(p)) > P_THRESHOLD


@pytest.mark.parametrize("case", ["random", "q_equals_p", "disjoint"])
def test_tree_emits_target_distribution(case):
    p, q = cases()[case]
    counts = tree_first_two(p, q, N_TREE, seed=3)
    assert chi2_pvalue(counts, joint_target(p)) > P_THRESHOLD


def test_tree_deterministic_draft_emits_target_distribution():
    p, q = cases()["random"]
    counts = tree_first_two(p, q, N_TREE, seed=4, deterministic=True)
    assert chi2_pvalue(counts, joint_target(p)) > P_THRESHOLD


def _always_accept(u, p_x, q_x):
    return torch.ones_like(torch.as_tensor(p_x), dtype=torch.bool)


def _residual_is_p(p, q):
    return p


BROKEN = [("accepts", _always_accept), ("residual", _residual_is_p)]


@pytest.mark.parametrize("rule,broken", BROKEN, ids=["always_accept", "resample_from_p"])
def test_broken_rules_fail_the_chain_test(monkeypatch, rule, broken):
    monkeypatch.setattr(verify, rule, broken)
    p, q = cases()["random"]
    counts = chain_first_two(p, q, N_CHAIN, k=3, seed=14)
    assert chi2_pvalue(counts, joint_target(p)) < BROKEN_THRESHOLD


@pytest.mark.parametrize("rule,broken", BROKEN, ids=["always_accept", "resample_from_p"])
def test_broken_rules_fail_the_tree_test(monkeypatch, rule, broken):
    monkeypatch.setattr(verify, rule, broken)
    p, q = cases()["random"]
    counts = tree_first_two(p, q, N_TREE, seed=3)
    assert chi2_pvalue(counts, joint_target(p)) < BROKEN_THRESHOLD


def test_broken_rule_fails_with_a_deterministic_draft(monkeypatch):
    """With q = one-hot the residual is 'p without x'; resampling from p instead must be caught too."""
    monkeypatch.setattr(verify, "residual", _residual_is_p)
    p, q = cases()["random"]
    counts = chain_first_two(p, q, N_CHAIN, k=3, seed=5, deterministic=True)
    assert chi2_pvalue(counts, joint_target(p)) < BROKEN_THRESHOLD


@pytest.mark.parametrize("case", ["random", "q_equals_p", "disjoint", "delta"])
def test_acceptance_rate_matches_sum_of_min(case):
    """Empirical acceptance of one draft token x ~ q equals sum_x min(p(x), q(x)) (delta: q = one-hot)."""
    p, q = cases()["random" if case == "delta" else case]
    n = 100_000
    g = torch.Generator().manual_seed(21)
    ctx = torch.full((n,), X0, dtype=torch.long)
    deterministic = case == "delta"
    accepted, _, draft = chain_round(p, q, ctx, 1, g, deterministic)
    q0 = torch.zeros(V, dtype=torch.float64).scatter_(0, draft[:1, 0], 1.0) if deterministic else q[X0]
    expected = float(expected_acceptance_rate(p[X0], q0))
    observed = float(accepted.double().mean())
    sigma = max((expected * (1 - expected) / n) ** 0.5, 1e-12)
    assert abs(observed - expected) <= 5 * sigma + 1e-12, (observed, expected)


def test_sample_without_replacement_order():
    """The second draw is distributed as q with the first removed (what the tree rule assumes)."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = 20_000
    pairs = np.zeros((4, 4), dtype=np.int64)
    draws = sample_without_replacement(q.expand(n, -1), 2, g)
    np.add.at(pairs, (draws[:, 0].numpy(), draws[:, 1].numpy()), 1)
    exact = (q[:, None] * q[None, :] / (1 - q[:, None])).numpy()
    np.fill_diagonal(exact, 0)
    assert chi2_pvalue(pairs, exact) > P_THRESHOLD


# ------------------------------------------------------------------------------------------ greedy and warping


def test_greedy_chain_rule():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 0]])
    accepted, nxt = verify_chain_greedy(draft, target)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [8, 6, 4]


def test_greedy_tree_rule():
    # root children: node0 (tok 5), node1 (tok 6); node0 -> node2 (tok 7), node3 (tok 8); node3 -> node4 (tok 9)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    parents = [-1, -1, 0, 0, 3]
    # target argmax after root=6 -> node1; after node1 = 3 (no children) -> emit 3
    assert verify_tree_greedy(tokens, parents, torch.tensor([6, 0, 3, 0, 0, 0])) == ([1], 3)
    # after root=5 -> node0; after node0 = 8 -> node3; after node3 = 9 -> node4; after node4 = 2 (bonus)
    assert verify_tree_greedy(tokens, parents, torch.tensor([5, 8, 0, 0, 9, 2])) == ([0, 3, 4], 2)
    assert verify_tree_greedy(tokens, parents, torch.tensor([1, 8, 0, 0, 9, 2])) == ([], 1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)])
def test_warping_matches_transformers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = probabilities(logits, Sampling(temperature, top_p, top_k))
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(ours, ref.softmax(-1))


# ------------------------------------------------------------------------------------ end to end, tiny models


class _TinyTokenizer:
    bos_token_id, eos_token_id, pad_token_id, unk_token_id = 0, None, None, None
    all_special_tokens = ["t0"]

    def get_vocab(self):
        return {f"t{i}": i for i in range(V)}


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.targets import Target

    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:  # O(1) logits: context-dependent, not too peaked
                param.normal_(0, param.shape[1] ** -0.5)
    return Target(name=f"tiny-llama-{seed}", model=model, tokenizer=_TinyTokenizer())


@pytest.mark.parametrize("tree", [pytest.param([[0], [1], [0, 0], [0, 1], [1, 0]], id="static-tree"),
                                  pytest.param("chain", id="chain"),
                                  pytest.param(Chain(2, min_confidence=0.25), id="chain-stops-after-1-or-2"),
                                  pytest.param(Chain(2, min_confidence=0.4), id="chain-stops-after-0-or-1")])
def test_engine_end_to_end_samples_the_target(tree):
    """The whole engine (draft model with its own cache, tree masks, q rows, lazy warped p rows, KV compaction)
    on two random 1-layer Llamas: tokens 2 and 3 (both from speculative steps; token 1 is the prefill's) follow
    the target's warped joint distribution, computed exactly by enumeration."""
    assert engine_pvalue(tree) > P_THRESHOLD


@pytest.mark.parametrize("tree", [pytest.param([[0], [1], [0, 0]], id="static-tree"), pytest.param("chain", id="chain")])
def test_a_draft_model_with_a_draft_vocabulary_samples_the_target(tree):
    """A draft that proposes from 4 of the 6 tokens only (q = 0 on the others): the target still decides every
    token, so the engine's output keeps the target's distribution."""
    from drafttrain.decoding import build_proposer

    def narrowed(target):
        return build_proposer("draft_model", target, draft=_tiny_llama(1), vocab=torch.tensor([0, 2, 3, 5]))

    assert engine_pvalue(tree, proposer=narrowed) > P_THRESHOLD


def test_a_stop_rule_that_reads_the_drawn_token_fails_the_engine_test(monkeypatch):
    """Guard for the confidence stop: proposing only the draws the draft is sure of (a rule that reads the drawn
    token, not just the distribution) no longer proposes from q, and the same test must catch the bias."""
    from drafttrain.decoding.expand import TreeDrafter

    honest = TreeDrafter._draw

    def only_confident_draws(self, logits, m, request):
        tokens, q = honest(self, logits, m, request)
        if q is not None and float(q[tokens[0]]) < 0.4:
            tokens = [int(q.argmax())]  # an unsure draw is swapped for the sure token, but q is still reported
        return tokens, q

    monkeypatch.setattr(TreeDrafter, "_draw", only_confident_draws)
    assert engine_pvalue("chain") < BROKEN_THRESHOLD


def engine_pvalue(tree, proposer=None) -> float:
    """p-value of the engine's tokens 2 and 3 against the target's exact joint distribution. ``proposer``:
    fn(target) -> Proposer (default: a second tiny model as draft model)."""
    from drafttrain.decoding import SpeculativeDecoder, build_proposer

    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, draft = _tiny_llama(0), _tiny_llama(1)
        prompt = [0, 3, 1]
        sampling = Sampling(1.0, 0.9, 0)
        with torch.no_grad():
            def dist(ctx):
                return probabilities(target.model(torch.tensor([ctx])).logits[0, -1].double(), sampling)

            exact = torch.zeros(V, V, dtype=torch.float64)  # P(token 2 = b, token 3 = c)
            p1 = dist(prompt)
            for a in range(V):
                if p1[a] > 0:
                    p2 = dist(prompt + [a])
                    for b in range(V):
                        if p2[b] > 0:
                            exact[b] += p1[a] * p2[b] * dist(prompt + [a, b])
        chosen = proposer(target) if proposer else build_proposer("draft_model", target, draft=draft)
        decoder = SpeculativeDecoder(target, chosen, depth=2, tree=tree, temperature=1.0, top_p=0.9)
        counts = np.zeros((V, V), dtype=np.int64)
        for seed in range(800):
            decoder.seed = seed
            out = decoder.generate(prompt, 3).tokens
            counts[out[1], out[2]] += 1
    finally:
        torch.set_num_threads(old_threads)
    # pool cells too rare for the chi-squared approximation into one
    probs, flat = exact.numpy().ravel(), counts.ravel()
    rare = probs * flat.sum() < 5
    assert flat[probs == 0].sum() == 0
    pooled_counts = np.append(flat[~rare], flat[rare].sum())
    pooled_probs = np.append(probs[~rare], probs[rare].sum())
    return chi2_pvalue(pooled_counts, pooled_probs)
