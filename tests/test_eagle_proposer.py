"""EAGLE proposers through the real engine on SmolLM2: greedy output identical to the target's own, for chains,
static trees and EAGLE-2 dynamic trees, with heads that really get tokens accepted (overfitted in the test)."""

from __future__ import annotations

import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig, Eagle3Config, EagleConfig
from drafttrain.decoding.engine import SpeculativeDecoder, plain_decode
from drafttrain.decoding.proposers import build_proposer
from drafttrain.decoding.trees import Chain, DynamicTree
from drafttrain.drafts import Drafter, build_drafter
from drafttrain.targets import run_target

PROMPT = [{"role": "user", "content": "List three facts about the moon."}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_and_greedy(smollm2):
    ids = smollm2.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    return ids, plain_decode(smollm2, ids, NEW_TOKENS).tokens


def overfit_head(target, cfg, ids, continuation, steps=30, lr=3e-3):
    """Train a head on one sequence (prompt + the target's own answer) until it predicts it well."""
    torch.manual_seed(0)
    head = build_drafter(cfg, target).train()
    tokens = torch.tensor([ids + continuation])
    batch = {"input_ids": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
             "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        features = run_target(target, batch, head.needs())
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = head.training_step(batch, features)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return head.eval(), losses


# EAGLE-3.1's norms and a window of 16 (shorter than prompt + answer: in play) in one head; each option's training
# path is held to its decoding path one by one in test_drafts.py
EAGLE3_OPTIONS = {"eagle3": {}, "eagle3.1-window": {"fc_norm": True, "norm_output": True, "sliding_window": 16}}


@pytest.fixture(scope="module", params=[*EAGLE3_OPTIONS, "eagle"])
def trained_head(request, smollm2, prompt_and_greedy):
    ids, greedy = prompt_and_greedy
    if request.param in EAGLE3_OPTIONS:
        # 20 steps: a step here costs 1.5 s (three unrolled steps over the whole 49k vocabulary); the confidence-
        # stopped chain accepted 9 tokens after 15 steps (3 after 12), past the greedy test's floor of 8
        head, losses = overfit_head(smollm2, Eagle3Config(ttt_steps=3, **EAGLE3_OPTIONS[request.param]), ids,
                                    greedy, steps=20, lr=3e-3)
    else:  # feature regression on unnormalised hidden states wants a smaller step
        head, losses = overfit_head(smollm2, EagleConfig(noise=0.0), ids, greedy, lr=1e-3)
    return head, losses


@pytest.mark.slow
def test_overfitting_lowers_the_loss(trained_head):
    _, losses = trained_head
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree",
    ["chain", Chain(4, min_confidence=0.6), [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]],
     DynamicTree(total_tokens=12, depth=5, top_k=3)],
    ids=["chain", "chain-confidence-stop", "static", "dynamic"],
)
def test_eagle_greedy_equals_target_greedy_with_acceptances(smollm2, prompt_and_greedy, trained_head, tree):
    ids, greedy = prompt_and_greedy
    head, _ = trained_head
    proposer = build_proposer(head.proposer, smollm2, draft=head)
    out = SpeculativeDecoder(smollm2, proposer, depth=4, tree=tree).generate(ids, NEW_TOKENS)
    assert out.tokens == greedy
    assert sum(out.stats.accepted_per_step) > NEW_TOKENS // 4, out.stats.accepted_per_step  # the path is exercised
    assert out.stats.target_forwards < NEW_TOKENS


def test_eagle_greedy_on_a_prompt_it_was_not_trained_on(smollm2, trained_head):
    head, _ = trained_head
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name two rivers in Europe."}],
                                                add_generation_prompt=True, return_dict=True)["input_ids"]
    new_tokens = 16  # 0.1 s a token on a CPU; rejected drafts are exercised from the first cycle
    greedy = plain_decode(smollm2, ids, new_tokens).tokens
    for tree in ("chain", DynamicTree(total_tokens=10, depth=4, top_k=3)):
        out = SpeculativeDecoder(smollm2, build_proposer(head.proposer, smollm2, draft=head), depth=5,
                                 tree=tree).generate(ids, new_tokens)
        assert out.tokens == greedy


class NotAnEagleHead(Drafter):
    kind, proposer = "other", "draft_model"


def test_eagle_proposer_refuses_bad_drafts(smollm2, tmp_path):
    with pytest.raises(DrafttrainError, match="needs draft="):
        build_proposer("eagle", smollm2)
    with pytest.raises(DrafttrainError, match="no draft checkpoint at"):
        build_proposer("eagle", smollm2, draft=str(tmp_path / "missing"))
    with pytest.raises(DrafttrainError, match="a other draft, served by the 'draft_model' proposer"):
        build_proposer("eagle", smollm2, draft=NotAnEagleHead(DraftConfig(kind="other")))
