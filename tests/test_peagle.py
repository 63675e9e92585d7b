"""P-EAGLE (the EAGLE-3 kind's parallel section): COD sampling, the mask, a training step, the proposer drafting what
training computes, losslessness, and the speculators export."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fitted_on_its_answer
from safetensors.torch import load_file
from test_dflash import batch_of, randomised, tiny_target

from drafttrain import DrafttrainError
from drafttrain.config import Eagle3Config
from drafttrain.decoding import DraftRequest, Sampling, SpeculativeDecoder, build_proposer
from drafttrain.decoding.trees import Chain, StaticTree
from drafttrain.drafts import build_drafter, layers, load_drafter
from drafttrain.drafts.layers import row_mask_attention
from drafttrain.drafts.peagle import ParallelMask, Rollouts, cod_rollouts, parallel_mask
from drafttrain.export import export_draft
from drafttrain.export.writer import export_checkpoint
from drafttrain.targets import load_target, run_target

MASK = 63


def tiny_peagle(target, depths: int = 4, **changes):
    config = Eagle3Config(parallel={"depths": depths, "mask_token_id": MASK}, ttt_steps=1, **changes)
    return randomised(build_drafter(config, target))


def test_cod_keeps_contiguous_rollouts_of_labelled_slots_in_shrinking_shares():
    trainable = torch.zeros(40)
    trainable[5:35] = 1
    rollouts = cod_rollouts(trainable, 5, ratio=0.7, floor=0.2, generator=torch.Generator().manual_seed(0))
    slots = set(zip(rollouts.anchors.tolist(), rollouts.depths.tolist()))
    for anchor, depth in slots:
        assert trainable[anchor + depth] == 1  # every slot has a label
        assert depth == 1 or (anchor, depth - 1) in slots  # a rollout reaches depth d only through d - 1
    seeds = 30
    for depth in range(1, 5):
        kept = sum(1 for _, d in slots if d == depth)
        assert kept <= int((seeds - depth) * max(0.7**depth, 0.2))
    assert sum(1 for _, d in slots if d == 1) == int(29 * 0.7)


def test_a_mask_slot_sees_the_text_up_to_its_anchor_and_its_own_rollout():
    rollouts = Rollouts(anchors=torch.tensor([2, 2, 4]), depths=torch.tensor([1, 2, 1]))
    mask = parallel_mask(6, rollouts)
    assert torch.equal(mask[:6, :6], torch.ones(6, 6, dtype=torch.bool).tril())  # the text: causal
    assert not mask[:6, 6:].any()  # the text never sees mask slots
    assert mask[6].tolist() == [True, True, True, False, False, False, True, False, False]  # (2, 1)
    assert mask[7].tolist() == [True, True, True, False, False, False, True, True, False]  # (2, 2)
    assert mask[8].tolist() == [True] * 5 + [False, False, False, True]  # (4, 1): not anchor 2's rollout


def some_rollouts(length: int = 30, depths: int = 5) -> Rollouts:
    trainable = torch.ones(length)
    trainable[:3] = 0
    return cod_rollouts(trainable, depths, ratio=0.7, floor=0.2, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("chunk", [7, 16, 200])
def test_the_mask_attended_in_chunks_of_rows_equals_the_whole_mask_forward_and_backward(chunk):
    """A long row's (T + S)^2 mask and scores are never held: chunks of query rows (recomputed in backward)
    compute what one attention over the whole mask computes, gradients included, a short last chunk covered."""
    rollouts = some_rollouts()
    mask = ParallelMask(30, rollouts)
    g = torch.Generator().manual_seed(1)
    n = mask.keys
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, requires_grad=True) for _ in range(3))
    probe = torch.randn(2, 4, n, 8, generator=g)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=parallel_mask(30, rollouts))
    expected = torch.autograd.grad((whole * probe).sum(), (q, k, v))
    chunked = row_mask_attention(q, k, v, mask, chunk=chunk)
    got = torch.autograd.grad((chunked * probe).sum(), (q, k, v))
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rows_of_the_mask_are_its_whole_matrix_cut_and_a_chunk_offset_mistake_would_be_caught():
    rollouts = some_rollouts()
    mask = ParallelMask(30, rollouts)
    whole = parallel_mask(30, rollouts)
    assert torch.equal(torch.cat([mask.rows(a, min(a + 9, mask.keys)) for a in range(0, mask.keys, 9)]), whole)
    assert not torch.equal(torch.cat([mask.rows(0, 9)] * (mask.keys // 9 + 1))[: mask.keys], whole)


def test_a_long_p_eagle_row_keeps_for_backward_what_grows_linearly_in_its_length(monkeypatch):
    """The saved bytes of one P-EAGLE training step (autograd's own saved-tensor hooks) at 1k and 2k tokens, both
    past the whole-mask budget (lowered here so that rows this short are chunked): twice the row, about twice the
    bytes (the whole (T + S)^2 mask kept for backward would make it nearly four times)."""
    monkeypatch.setattr(layers, "ROW_MASK_ENTRIES", 2**20)
    target = tiny_target()
    drafter = tiny_peagle(target, depths=8).train()

    def saved_bytes(length):
        torch.manual_seed(0)
        ids = torch.randint(0, 60, (1, length))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(1, length)}
        outputs = run_target(target, batch, drafter.needs())
        bases = {}

        def pack(x):
            base = x._base if x._base is not None else x
            bases[id(base)] = base.numel() * base.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            drafter.training_step(batch, outputs)
        return sum(bases.values())

    assert saved_bytes(2048) < 2.6 * saved_bytes(1024)


def test_a_parallel_training_step_trains_the_mask_state_and_scores_every_depth():
    target = tiny_target()
    drafter = tiny_peagle(target).train()
    batch = batch_of(target)
    out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
    assert torch.isfinite(out.loss) and len(out.counted) == 4 and all(n > 0 for n in out.counted)
    assert out.counted[0] > out.counted[1] > out.counted[3]  # COD keeps fewer slots at each depth
    out.loss.backward()
    for name in ("mask_hidden", "mask_embedding", "fc.weight", "midlayer.self_attn.q_proj.weight"):
        grad = dict(drafter.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_the_parallel_proposer_drafts_what_training_computes():
    target = tiny_target()
    drafter = tiny_peagle(target).eval()
    ids = batch_of(target)["input_ids"][:1]
    outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
    anchor = 10  # the last real pair: (state at 10, token 11); it and its mask slots predict tokens 12..15
    rollout = Rollouts(anchors=torch.full((3,), anchor), depths=torch.arange(1, 4))
    with torch.no_grad():
        logits, positions, _ = drafter._parallel_logits(outputs.hidden[0, : anchor + 2], ids[0, : anchor + 2], rollout)
    trained = drafter.draft_to_target[logits[[anchor, anchor + 2, anchor + 3, anchor + 4]].argmax(-1)]  # real, then masks
    proposer = build_proposer("eagle", target, draft=drafter)
    proposer.prefill(ids[:, : anchor + 1], outputs.hidden[:, : anchor + 1], ids[:, anchor + 1: anchor + 2])
    draft = proposer.propose(DraftRequest(Chain(4), Sampling()))
    assert draft.tokens[0].tolist() == trained.tolist()
    assert proposer.length == anchor + 1 and all(c.length == anchor + 1 for c in proposer.caches)  # drafts forgotten


@pytest.mark.parametrize("tree", [pytest.param([[0], [1], [0, 0], [1, 0], [0, 0, 0]], id="static-tree"),
                                  pytest.param("chain", id="chain")])
def test_the_parallel_proposer_samples_the_target_exactly(tree):
    from test_decoding_sampling import P_THRESHOLD, engine_pvalue

    def peagle(target):
        config = Eagle3Config(parallel={"depths": 3, "mask_token_id": 5}, ttt_steps=1)
        return build_proposer("eagle", target, draft=randomised(build_drafter(config, target)))

    assert engine_pvalue(tree, proposer=peagle) > P_THRESHOLD


def test_the_speculators_export_carries_the_mask_state_and_row_and_loads_back(tmp_path):
    target = tiny_target()
    drafter = tiny_peagle(target).eval()
    checkpoint = drafter.save_pretrained(tmp_path / "checkpoint")
    assert drafter.export_formats() == ("speculators",)  # what scripts/tools/check_serving.py exports by default
    with pytest.raises(DrafttrainError, match="speculators"):
        export_draft(checkpoint, "vllm", tmp_path / "vllm", target)
    export = export_draft(checkpoint, "speculators", tmp_path / "export", target)
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert "mask_token_id" not in config["transformer_layer_config"]
    tensors = load_file(str(export / "model.safetensors"))
    assert tensors["mask_hidden"].shape == drafter.mask_hidden.shape
    assert torch.equal(tensors["embed_tokens.weight"][MASK], drafter.mask_embedding.detach())
    assert torch.equal(tensors["embed_tokens.weight"][0], target.model.get_input_embeddings().weight[0])
    ids = batch_of(target)["input_ids"][:1]
    outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
    rollout = Rollouts(anchors=torch.full((3,), 9), depths=torch.arange(1, 4))
    with torch.no_grad():
        expected = drafter._parallel_logits(outputs.hidden[0], ids[0], rollout)[0]
        for folder in (checkpoint, export):
            loaded = load_drafter(folder, target)
            torch.testing.assert_close(loaded._parallel_logits(outputs.hidden[0], ids[0], rollout)[0], expected)


def test_export_without_a_format_writes_the_one_a_p_eagle_head_can_be_served_from(folder_target, tmp_path):
    target = load_target(str(folder_target))
    checkpoint = tiny_peagle(target).save_pretrained(tmp_path / "checkpoint")
    export = export_checkpoint(checkpoint, None, tmp_path / "export", str(folder_target))  # the kind's first: vllm
    config = json.loads((export / "config.json").read_text())
    assert config["drafttrain"]["export"]["format"] == "speculators"
    assert config["speculators_model_type"] == "peagle"


def test_parallel_depths_of_one_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="1 is one token per forward"):
        Eagle3Config(parallel={"depths": 1})


@pytest.mark.slow
def test_greedy_output_is_the_targets_on_smollm2_chain_and_tree(smollm2):
    config = Eagle3Config(parallel={"depths": 4}, init_from_target=["lm_head", "layer", "fc"])
    drafter, prompt, greedy, losses = fitted_on_its_answer(smollm2, config, 20, 1e-3)
    assert losses[-1] < losses[0] / 2, losses
    for tree in ("chain", StaticTree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])):
        out = SpeculativeDecoder(smollm2, build_proposer("eagle", smollm2, draft=drafter), depth=4,
                                 tree=tree).generate(prompt, 40)
        assert out.tokens == greedy
        assert sum(out.stats.accepted_per_step) > 5, out.stats.accepted_per_step
