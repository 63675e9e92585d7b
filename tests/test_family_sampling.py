"""Sampling stays exactly the target's for one family of each cache kind (full attention with MoE, sliding window,
MLA, recurrent linear attention, short convolutions): tokens 2 and 3 of the engine's output at T=1 (both from
speculative steps, each after a rollback of whatever the draft got wrong) against the target's exact joint
distribution, computed by enumeration without any cache. A deliberately broken sampler fails the same test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import ONE_PER_CACHE_KIND, WINDOW, family_model
from test_decoding_sampling import BROKEN_THRESHOLD, P_THRESHOLD, _TinyTokenizer, chi2_pvalue

from drafttrain.decoding import SpeculativeDecoder, build_proposer
from drafttrain.sampling import Sampling, probabilities
from drafttrain.targets import Target

V = 6
PROMPT = [0, 3, 1, 4, 1, 5, 2, 0, 3, 5, 4]  # longer than the window: the cache slides while it decodes
SAMPLES = 400  # the broken sampler's bias shows far sooner: 200 draws


def tiny(family: str, seed: int) -> Target:
    return Target(f"{family}-{seed}", family_model(family, seed=seed, vocab_size=V), _TinyTokenizer())


def exact_joint(target: Target, sampling: Sampling) -> np.ndarray:
    """P(token 2 = b, token 3 = c) under the target's warped distribution, by full forwards without a cache."""
    def dist(ctx):
        return probabilities(target.model(torch.tensor([ctx])).logits[0, -1].double(), sampling)

    exact = torch.zeros(V, V, dtype=torch.float64)
    with torch.no_grad():
        p1 = dist(PROMPT)
        for a in range(V):
            p2 = dist(PROMPT + [a])
            for b in range(V):
                exact[b] += p1[a] * p2[b] * dist(PROMPT + [a, b])
    return exact.numpy()


def engine_pvalue(family: str, samples: int = SAMPLES) -> tuple[float, int]:
    """The chi-squared p-value of the engine's tokens 2 and 3, and how many verifications refused a draft token."""
    target, draft = tiny(family, 0), tiny(family, 1)
    return joint_pvalue(target, build_proposer("draft_model", target, draft=draft), samples)


def joint_pvalue(target: Target, proposer, samples: int) -> tuple[float, int]:
    """The chi-squared p-value of tokens 2 and 3 sampled at T=1 by speculative decoding with ``proposer`` (depth 2)
    against the target's exact joint distribution, and how many verifications refused a draft token."""
    exact = exact_joint(target, Sampling(1.0, 1.0, 0))
    decoder = SpeculativeDecoder(target, proposer, depth=2, temperature=1.0)
    counts = np.zeros((V, V), dtype=np.int64)
    refused = 0
    for seed in range(samples):
        decoder.seed = seed
        out = decoder.generate(PROMPT, 3)
        counts[out.tokens[1], out.tokens[2]] += 1
        refused += sum(out.stats.rejected_per_step)
    probs, flat = exact.ravel(), counts.ravel()
    rare = probs * flat.sum() < 5
    return chi2_pvalue(np.append(flat[~rare], flat[rare].sum()), np.append(probs[~rare], probs[rare].sum())), refused


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread a test


@pytest.mark.parametrize("family", list(ONE_PER_CACHE_KIND.values()), ids=list(ONE_PER_CACHE_KIND))
def test_sampling_follows_the_target_for_every_cache_kind(family):
    assert len(PROMPT) > WINDOW
    pvalue, refused = engine_pvalue(family)
    assert refused > SAMPLES // 10  # rollbacks happened
    assert pvalue > P_THRESHOLD


@pytest.mark.parametrize("family", list(ONE_PER_CACHE_KIND.values()), ids=list(ONE_PER_CACHE_KIND))
def test_a_sampler_that_keeps_every_draft_token_fails(family, monkeypatch):
    """The broken rule emits the draft's distribution instead of the target's: the same test must reject it."""
    import drafttrain.decoding.engine as engine

    def accept_everything(tokens, p, q, generator):
        k = tokens.shape[1]
        return torch.tensor(k), int(torch.multinomial(p[0, k], 1, generator=generator))

    monkeypatch.setattr(engine, "verify_chain", accept_everything)
    assert engine_pvalue(family, samples=SAMPLES // 2)[0] < BROKEN_THRESHOLD
