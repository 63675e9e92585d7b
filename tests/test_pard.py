"""PARD (the draft-model kind's ``parallel``): a draft LM that proposes k tokens in one forward through mask tokens.
The training layout, the proposer drafting what training computes, losslessness, save/load and bad settings."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fitted_on_its_answer
from pydantic import ValidationError
from test_dflash import batch_of, tiny_target

from drafttrain.config import DraftModelConfig
from drafttrain.decoding import DraftRequest, Sampling, SpeculativeDecoder, build_proposer
from drafttrain.decoding.trees import Chain, StaticTree
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.targets import run_target

MASK = 63


def tiny_pard(target, depths: int = 4, **changes):
    return build_drafter(DraftModelConfig(cut="first:2", parallel={"depths": depths, "mask_token_id": MASK}, **changes), target)


def test_a_pard_training_step_scores_every_depth_of_the_cod_rollouts():
    target = tiny_target()
    drafter = tiny_pard(target).train()
    batch = batch_of(target)
    out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
    assert torch.isfinite(out.loss) and len(out.counted) == 4
    assert out.counted[0] > out.counted[1] > out.counted[3] > 0  # COD keeps fewer slots at each depth
    out.loss.backward()
    grads = [p.grad for p in drafter.student.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_the_pard_proposer_drafts_what_training_computes(monkeypatch):
    import drafttrain.drafts.pard as dm
    from drafttrain.drafts.peagle import Rollouts

    target = tiny_target()
    drafter = tiny_pard(target).eval()
    ids = batch_of(target)["input_ids"][:1]
    anchor = 10  # the text up to 10, then mask tokens: the real slot 10 and the masks predict tokens 11..14
    loss_mask = torch.zeros(1, ids.shape[1])
    loss_mask[0, anchor + 1: anchor + 5] = 1
    whole = Rollouts(anchors=torch.full((3,), anchor), depths=torch.arange(1, 4))
    monkeypatch.setattr(dm, "cod_rollouts", lambda *args, **kwargs: whole)  # one whole rollout instead of a sample
    logits, _, _ = drafter.parallel_logits({"input_ids": ids[:, : anchor + 1], "loss_mask": loss_mask[:, : anchor + 1]},
                                           None)
    trained = logits[0, [anchor, anchor + 1, anchor + 2, anchor + 3]].argmax(-1)
    proposer = build_proposer("draft_model", target, draft=drafter)
    proposer.prefill(ids[:, :anchor], None, ids[:, anchor: anchor + 1])
    draft = proposer.propose(DraftRequest(Chain(4), Sampling()))
    assert draft.tokens[0].tolist() == trained.tolist()
    assert proposer.cache.length == anchor + 1  # the masks are forgotten


@pytest.mark.parametrize("tree", [pytest.param([[0], [1], [0, 0], [1, 0], [0, 0, 0]], id="static-tree"),
                                  pytest.param("chain", id="chain")])
def test_the_pard_proposer_samples_the_target_exactly(tree):
    from test_decoding_sampling import P_THRESHOLD, engine_pvalue

    def pard(target):
        return build_proposer("draft_model", target,
                              draft=build_drafter(DraftModelConfig(cut="first:1", parallel={"depths": 3, "mask_token_id": 5}), target))

    assert engine_pvalue(tree, proposer=pard) > P_THRESHOLD


def test_a_saved_pard_draft_names_its_mask_token_for_engines_and_loads_back_parallel(tmp_path):
    target = tiny_target()
    drafter = tiny_pard(target).eval()
    folder = drafter.save_pretrained(tmp_path / "checkpoint")
    config = json.loads((folder / "config.json").read_text())
    assert config["pard_token"] == config["mask_token_id"] == MASK and config["spd_type"] == "pard"
    loaded = load_drafter(folder, target)
    assert loaded.mask_token_id == MASK and type(loaded).max_draft_depth(loaded.config) == 4
    proposer = build_proposer("draft_model", target, draft=loaded)
    assert proposer.shapes == (Chain, StaticTree) and proposer.max_depth == 4


def test_bad_parallel_settings_are_refused_with_their_reason():
    with pytest.raises(ValidationError, match="1 is one token per forward"):
        DraftModelConfig(cut="first:1", parallel={"depths": 1})
    with pytest.raises(ValidationError, match="on_policy must be 0"):
        DraftModelConfig(cut="first:1", parallel={"depths": 4}, on_policy=0.5)


@pytest.mark.slow
def test_greedy_output_is_the_targets_on_smollm2_chain_and_tree(smollm2):
    drafter, prompt, greedy, losses = fitted_on_its_answer(smollm2, DraftModelConfig(cut="every:6", parallel={"depths": 4}), 12, 3e-4)
    assert losses[-1] < losses[0], losses
    for tree in ("chain", StaticTree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])):
        out = SpeculativeDecoder(smollm2, build_proposer("draft_model", smollm2, draft=drafter), depth=4,
                                 tree=tree).generate(prompt, 40)
        assert out.tokens == greedy
