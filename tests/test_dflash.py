"""DFlash block drafting: anchors, the attention mask, the loss weights, a training step, the block proposer
(it drafts exactly what training computes, and it is lossless), save/export/load, and recipes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import REPO, draft_vocab_file, fitted_on_its_answer
from safetensors.torch import load_file
from test_export import tiny_target

from drafttrain.config import DFlashConfig, load_recipe
from drafttrain.decoding import DraftRequest, Sampling, SpeculativeDecoder, build_proposer
from drafttrain.decoding.trees import Chain, StaticTree
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.dflash import Blocks, dpace_weights, sample_anchors
from drafttrain.export import export_draft
from drafttrain.targets import run_target

TINY_MASK = 63  # the tiny target's last row: the mask token


def randomised(drafter):
    """Trained-looking weights: every trainable parameter random, so a misplaced tensor or mask shows."""
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.requires_grad:
                param.normal_(0, 0.3 if param.dim() > 1 else 0.05).add_(1.0 if param.dim() == 1 else 0.0)
    return drafter


def tiny_dflash(target, **changes) -> torch.nn.Module:
    config = DFlashConfig(block_size=4, anchors=8, num_layers=2, mask_token_id=TINY_MASK, **changes)
    return randomised(build_drafter(config, target))


def batch_of(target, rows=2, seq=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size - 1, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, :6] = 0  # a prompt
    mask[1, 18:] = 0  # a shorter second row (padding)
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}


def test_anchors_are_distinct_sorted_and_have_a_trainable_next_token():
    mask = torch.zeros(2, 20)
    mask[0, 5:15] = 1
    mask[1, 12:14] = 1
    blocks = sample_anchors(mask, 6, torch.Generator().manual_seed(0))
    for row in range(2):
        real = blocks.anchors[row][blocks.valid[row]].tolist()
        assert real == sorted(set(real)) and all(mask[row, p + 1] == 1 and p >= 1 for p in real)
    assert int(blocks.valid[0].sum()) == 6 and int(blocks.valid[1].sum()) == 2  # capped, and what there is


def test_dpace_weights_are_the_suffix_sums_of_the_acceptance_prefix_products():
    sure, mask = torch.ones(3), torch.ones(3)
    assert dpace_weights(sure, mask, 0.5).tolist() == [3.0, 2.0, 1.0]  # a slot counts for itself and all after it
    unsure = torch.zeros(3)  # s = alpha = 0.5 at every slot: prefix products 0.5, 0.25, 0.125
    assert dpace_weights(unsure, mask, 0.5).tolist() == pytest.approx([0.875, 0.375, 0.125])
    gap = torch.tensor([1.0, 1.0, 0.0])  # a slot without a label weighs nothing and does not cut the chain
    assert dpace_weights(sure, gap, 0.5).tolist() == [2.0, 1.0, 0.0]


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_a_block_sees_its_context_and_itself_never_another_block_or_later_context(attention):
    target = tiny_target()
    drafter = tiny_dflash(target, block_attention=attention).eval()
    anchors = torch.tensor([[3, 7]])
    blocks = Blocks(anchors, torch.ones_like(anchors, dtype=torch.bool))
    assert drafter.context_mask(blocks, 10)[0, 0, :, 0].tolist() == [[i < a for i in range(10)] for a in (3, 7)]
    inner = drafter.block_mask(4, "cpu")
    assert inner.all() if attention == "bidirectional" else torch.equal(inner, torch.ones(4, 4).tril().bool())
    # what the computation sees: perturb the target states at and after block 0's anchor, and block 0's own token
    ids = batch_of(target)["input_ids"][:1, :10]
    taps = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs()).hidden
    with torch.no_grad():
        base = drafter.block_logits(taps, ids, blocks)
        later = taps.clone()
        later[:, 3:] += 1.0
        moved = drafter.block_logits(later, ids, blocks)
        torch.testing.assert_close(moved[0, 0], base[0, 0])  # block 0 never sees positions >= its anchor
        assert not torch.allclose(moved[0, 1], base[0, 1])  # block 1 sees positions 3..6
        other = ids.clone()
        other[0, 3] = (ids[0, 3] + 1) % 60  # block 0's anchor token
        changed = drafter.block_logits(taps, other, blocks)
        assert not torch.allclose(changed[0, 0], base[0, 0])
        torch.testing.assert_close(changed[0, 1], base[0, 1])  # another block's tokens are never seen


def test_a_training_step_has_the_shapes_the_weights_and_the_gradients_it_should():
    target = tiny_target()
    drafter = tiny_dflash(target).train()
    batch = batch_of(target)
    outputs = run_target(target, batch, drafter.needs())
    out = drafter.training_step(batch, outputs)
    assert torch.isfinite(out.loss) and out.loss > 0
    assert len(out.correct) == len(out.counted) == 3  # block 4: three predicted slots
    assert all(c <= n for c, n in zip(out.correct, out.counted)) and out.counted[0] > 0
    out.loss.backward()
    assert drafter.lm_head.weight.grad is None  # the target's rows, frozen
    for name in ("fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_norm.weight", "layers.1.mlp.down_proj.weight",
                 "norm.weight"):
        grad = dict(drafter.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_argmax_labels_are_the_soft_loss_against_the_target_sharpened_to_its_greedy_token():
    """labels: argmax trains each slot on the target's greedy token at the position before it: the soft loss against
    the target's logits × 10⁶ (one-hot on the argmax), on the same anchors with the same D-PACE weights; and it is not
    the soft loss against the target's own distribution."""
    target = tiny_target()
    drafter = tiny_dflash(target).train()
    batch = batch_of(target)
    outputs = run_target(target, batch, drafter.needs())
    sharpened = dataclasses.replace(outputs, logits=outputs.logits * 1e6)

    def loss(labels, target_outputs):
        drafter.config = drafter.config.model_copy(update={"labels": labels})
        torch.manual_seed(0)  # the same anchors
        return drafter.training_step(batch, target_outputs).loss.item()

    hard = loss("argmax", outputs)
    assert hard == pytest.approx(loss("soft", sharpened), rel=1e-5)
    assert hard != pytest.approx(loss("soft", outputs), rel=1e-2)


def test_a_training_step_runs_under_bf16_autocast():
    """The H200 check (2026-11-27) failed here: the masks filled bf16 scores with float32's lowest value, which
    bf16 cannot hold ("value cannot be converted to type c10::BFloat16 without overflow"). CPU autocast shows it."""
    target = tiny_target()
    drafter = tiny_dflash(target).train()
    batch = batch_of(target)
    outputs = run_target(target, batch, drafter.needs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter.training_step(batch, outputs)
    assert torch.isfinite(out.loss) and out.loss > 0
    out.loss.backward()
    assert dict(drafter.named_parameters())["fc.weight"].grad.abs().sum() > 0


def test_the_block_proposer_drafts_exactly_what_training_computes():
    """At inference the context is cached position by position and the block attends to it; in training every
    block is computed in one batched forward under the mask. The two must give the same predictions."""
    target = tiny_target()
    for attention in ("bidirectional", "causal"):
        drafter = tiny_dflash(target, block_attention=attention).eval()
        ids = batch_of(target)["input_ids"][:1]
        outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
        anchor = 11
        trained = drafter.block_logits_at(outputs.hidden, ids, torch.tensor([[anchor]]))[0, 0, 1:]
        proposer = build_proposer("block", target, draft=drafter)
        proposer.prefill(ids[:, :anchor], outputs.hidden[:, :5], ids[:, anchor: anchor + 1])  # the context in two parts
        proposer.accept(ids[:, anchor: anchor + 1], outputs.hidden[:, 5:anchor])
        draft = proposer.propose(DraftRequest(Chain(3), Sampling()))
        expected = drafter.draft_to_target[trained.argmax(-1)]
        assert draft.tokens[0].tolist() == expected.tolist(), attention


def test_a_shorter_draft_is_a_block_of_depth_plus_one_slots_as_vllm_serves_it():
    """vLLM drafts a block of num_speculative_tokens + 1 slots whatever the trained block; so does the evaluator, so
    that its counters are the engine's. A bidirectional draft of depth 2 from a block-4 drafter is exactly what the
    same weights compute in training with blocks of 3, and not what they compute with blocks of 4."""
    target = tiny_target()
    drafter = tiny_dflash(target).eval()
    narrow = build_drafter(DFlashConfig(block_size=3, anchors=8, num_layers=2, mask_token_id=TINY_MASK), target)
    narrow.load_state_dict(drafter.state_dict())
    ids = batch_of(target)["input_ids"][:1]
    outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
    anchor = 11
    drafted = build_proposer("block", target, draft=drafter)
    drafted.prefill(ids[:, :anchor], outputs.hidden[:, :anchor], ids[:, anchor: anchor + 1])
    draft = drafted.propose(DraftRequest(Chain(2), Sampling())).tokens[0].tolist()
    at = torch.tensor([[anchor]])
    served = narrow.block_logits_at(outputs.hidden, ids, at)[0, 0, 1:]
    whole = drafter.block_logits_at(outputs.hidden, ids, at)[0, 0, 1:3]
    assert draft == drafter.draft_to_target[served.argmax(-1)].tolist()
    confidences = torch.tensor(drafted.last_confidences)  # each slot's top probability: the logits, not just argmax
    assert torch.allclose(confidences, torch.softmax(served, -1).amax(-1), atol=1e-5)
    assert not torch.allclose(confidences, torch.softmax(whole, -1).amax(-1), atol=1e-3)  # the width shows


def test_a_static_tree_drafts_from_the_whole_block_its_rank_accuracies_measure():
    """Tree auto builds a block drafter's tree from rank accuracies measured with the whole trained block
    (measure_block_rank_accuracies); the tree's candidates must come from that same block, whatever its depth,
    which at some anchors differs from what a block of depth + 1 slots ranks."""
    target = tiny_target()
    drafter = tiny_dflash(target).eval()
    ids = batch_of(target)["input_ids"][:1]
    outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
    tree = StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])  # depth 2 of a block of 4 (3 drafted slots)

    def tree_tokens(logits):  # the tree's tokens from a block's [slots, V] logits
        ranked = drafter.draft_to_target[logits.topk(3, dim=-1).indices].tolist()
        return [ranked[d - 1][r] for d, r in zip(tree.depths, tree.ranks)]

    narrower_differs = 0
    for anchor in range(4, ids.shape[1] - 1):
        proposer = build_proposer("block", target, draft=drafter)
        proposer.prefill(ids[:, :anchor], outputs.hidden[:, :anchor], ids[:, anchor: anchor + 1])
        draft = proposer.propose(DraftRequest(tree, Sampling())).tokens[0].tolist()
        whole = drafter.block_logits_at(outputs.hidden, ids, torch.tensor([[anchor]]))[0, 0, 1:]
        contexts = [(cache.keys, cache.values) for cache in proposer.caches]
        narrow = drafter.draft_block(ids[:, anchor], anchor, contexts, 3)[0]
        assert draft == tree_tokens(whole), anchor
        narrower_differs += tree_tokens(narrow) != draft
    assert narrower_differs > 0  # the width shows somewhere, so the check above can fail


def test_sample_from_anchor_drafts_the_whole_block():
    target = tiny_target()
    drafter = tiny_dflash(target, sample_from_anchor=True)
    assert type(drafter).max_draft_depth(drafter.config) == 4 and drafter.first_predicted_slot() == 0
    out = drafter.training_step(batch_of(target), run_target(target, batch_of(target), drafter.needs()))
    assert len(out.counted) == 4


@pytest.mark.parametrize("tree", [pytest.param([[0], [1], [0, 0], [1, 0], [0, 0, 0]], id="static-tree"),
                                  pytest.param("chain", id="chain")])
def test_the_block_proposer_samples_the_target_exactly(tree):
    """The χ² engine test of test_decoding_sampling with a block drafter (its candidates are deterministic: one-hot
    drafts, so the target's distribution is kept)."""
    from test_decoding_sampling import P_THRESHOLD, engine_pvalue

    def block(target):
        config = DFlashConfig(block_size=4, anchors=4, mask_token_id=5, init_from_target=False)
        return build_proposer("block", target, draft=randomised(build_drafter(config, target)))

    assert engine_pvalue(tree, proposer=block) > P_THRESHOLD


def test_save_export_and_load_round_trip(tmp_path):
    target = tiny_target()
    keep = list(range(0, 64, 2))
    config = DFlashConfig(block_size=4, anchors=8, mask_token_id=TINY_MASK,
                          draft_vocab=str(draft_vocab_file(tmp_path, keep, 64)))
    drafter = randomised(build_drafter(config, target)).eval()
    checkpoint = drafter.save_pretrained(tmp_path / "checkpoint")
    export = export_draft(checkpoint, "speculators", tmp_path / "export", target)
    written = json.loads((export / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash" and written["mask_token_id"] == TINY_MASK
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert written["sliding_window_non_causal"] is True and "model_type" not in written
    assert written["aux_hidden_state_layer_ids"] == drafter.layer_ids
    tensors = load_file(str(export / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (32, 32) and tensors["d2t"].shape == (32,)
    assert "layers.0.self_attn.q_norm.weight" in tensors and "embed_tokens.weight" not in tensors
    ids = batch_of(target)["input_ids"][:1]
    outputs = run_target(target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, drafter.needs())
    anchors = torch.tensor([[8, 12]])
    expected = drafter.block_logits_at(outputs.hidden, ids, anchors)
    for folder in (checkpoint, export):
        loaded = load_drafter(folder, target)
        torch.testing.assert_close(loaded.block_logits_at(outputs.hidden, ids, anchors), expected)


def test_a_whole_vocabulary_export_has_no_vocabulary_map_and_loads_back(tmp_path):
    target = tiny_target()
    drafter = tiny_dflash(target, block_attention="causal")
    export = export_draft(drafter.save_pretrained(tmp_path / "c"), "speculators", tmp_path / "e", target)
    tensors = load_file(str(export / "model.safetensors"))
    assert not {"d2t", "t2d"} & set(tensors) and "lm_head.weight" in tensors  # vLLM wants d2t only for a draft vocab
    written = json.loads((export / "config.json").read_text())
    assert written["sliding_window_non_causal"] is False
    assert written["transformer_layer_config"]["layer_types"] == ["sliding_attention"] * 2
    loaded = load_drafter(export, target)
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight)


@pytest.mark.slow
def test_greedy_output_is_the_targets_on_smollm2_chain_and_tree(smollm2):
    """A block drafter fitted for a few steps on the target's own answer (it learns: the loss falls), served through
    chains and a static tree: identical tokens to plain greedy decoding."""
    config = DFlashConfig(block_size=4, anchors=32, init_from_target=True)
    drafter, prompt, greedy, losses = fitted_on_its_answer(smollm2, config, 30, 1e-3)
    assert losses[-1] < losses[0] / 2, losses
    for tree in ("chain", StaticTree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])):
        out = SpeculativeDecoder(smollm2, build_proposer("block", smollm2, draft=drafter), depth=3,
                                 tree=tree).generate(prompt, 40)
        assert out.tokens == greedy


def test_the_dflash_recipes_validate():
    recipe = load_recipe(REPO / "recipes" / "smollm2_dflash.yaml")
    assert recipe.draft.kind == "dflash" and recipe.draft.block_size >= 4
    for name in ("dflash_llama3.1_8b.yaml", "dflash_qwen3_8b.yaml"):
        cluster = load_recipe(REPO / "recipes" / name)
        assert cluster.draft.num_layers >= 3 and not math.isnan(cluster.training.learning_rate)


@pytest.mark.slow
def test_a_dflash_run_killed_mid_training_resumes_to_the_uninterrupted_runs_losses(tmp_path, folder_target):
    """`drafttrain train` killed (SIGKILL) once its step-3 checkpoint is written, then `--resume`: steps 4-6 give the
    losses of a run that was never interrupted (the anchors come from the restored random state)."""
    from conftest import killed_and_straight_losses, small_recipe

    from drafttrain.commands import main

    recipes = {}
    for name in ("straight", "killed"):
        (tmp_path / name).mkdir()
        recipes[name] = small_recipe(tmp_path / name, {"kind": "dflash", "block_size": 4, "anchors": 8},
                                     target={"model": str(folder_target)}, eval={"every_checkpoint": False},
                                     training={"batch_size": 2, "max_steps": 6, "save_every": 3, "log_every": 1})
        assert main(["prepare", str(recipes[name]), "--no-progress"]) == 0  # here: only the training is killed
    losses = killed_and_straight_losses(recipes)
    assert sorted(losses["killed"]) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert losses["killed"][step] == pytest.approx(losses["straight"][step], rel=0, abs=1e-5)
