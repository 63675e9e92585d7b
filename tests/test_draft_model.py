"""Distilled draft models: students cut from the target, divergences and their acceptance, the teacher cache,
on-policy data, selective distillation, save/load as a plain HF folder, resume, recipes and bad input."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import REPO, draft_vocab_file, small_recipe
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from drafttrain import DrafttrainError
from drafttrain.config import DraftModelConfig, load_recipe
from drafttrain.decoding.verify import expected_acceptance_rate
from drafttrain.drafts import build_drafter, load_drafter, losses
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.draft_model import cut_from_target, keep_learnable
from drafttrain.sources.cache import FeatureCache, write_feature_cache
from drafttrain.sources.hf import HFForward
from drafttrain.targets import Target, TargetNeeds, run_target


def tiny_target(seed=0, layers=4, vocab=64) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), None)


def batch_of(vocab=64, rows=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, :5] = 0
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}


def test_a_cut_student_computes_the_target_through_its_kept_layers():
    target = tiny_target(layers=6)
    student = cut_from_target(target, [0, 2, 5])
    ids = torch.randint(0, 64, (1, 10))
    model = target.model.model
    with torch.no_grad():
        h = model.embed_tokens(ids)
        positions = torch.arange(10).unsqueeze(0)
        cos_sin = model.rotary_emb(h, positions)
        for index in (0, 2, 5):
            out = model.layers[index](h, position_embeddings=cos_sin, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out
        want = target.model.lm_head(model.norm(h))
        assert torch.allclose(student(ids).logits, want, atol=1e-5)
    assert student.config.num_hidden_layers == 3
    assert [len(cut_from_target(target, c).model.layers) for c in ("every:2", "first:4")] == [3, 4]


@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd", "tvd"])
def test_a_draft_equal_to_its_target_has_zero_divergence_and_full_acceptance(divergence):
    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="every:1", divergence=divergence), target)
    batch = batch_of()
    out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
    assert float(out.loss) == pytest.approx(0.0, abs=1e-5)
    assert out.metrics["acceptance"] == pytest.approx(1.0, abs=1e-5) and out.correct == out.counted


def test_the_logged_acceptance_is_the_exact_acceptance_of_a_one_token_chain():
    """β = 1 - TVD(p, q) is what speculative sampling accepts: the sum over draft tokens x of q(x)·min(1, p/q),
    computed exactly here (no sampling) from the verification rule, on a toy target and draft."""
    target = tiny_target(seed=0)
    drafter = build_drafter(DraftModelConfig(cut="first:2"), target)
    with torch.no_grad():
        for p in drafter.student.parameters():
            p.add_(0.3 * torch.randn_like(p))  # a draft that disagrees
    ids = torch.randint(0, 64, (1, 6))
    batch = {"input_ids": ids, "loss_mask": torch.tensor([[0, 0, 0, 0, 0, 1]]), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
        p = torch.softmax(target.model(ids).logits[0, 4], -1).double()
        q = torch.softmax(drafter.student(ids).logits[0, 4], -1).double()
    exact = float(sum(q[x] * min(1.0, float(p[x] / q[x])) for x in range(64)))
    assert out.metrics["acceptance"] == pytest.approx(exact, abs=1e-5)
    assert float(expected_acceptance_rate(p, q)) == pytest.approx(exact, abs=1e-9)
    assert exact < 0.95  # a real disagreement is measured


def test_held_out_beta_adds_up_exactly_over_rows_and_is_measured_for_sft_too():
    """β on held-out rows, as checkpoint evaluation logs it (val_beta): 1 - TVD(p, q) averaged over every trainable
    token of every row; an SFT student, which trains on the data's tokens alone, is measured the same way."""
    from drafttrain.evaluation.checkpoint_eval import held_out

    target = tiny_target()
    fkl = build_drafter(DraftModelConfig(cut="first:2"), target)
    with torch.no_grad():
        for p in fkl.student.parameters():
            p.add_(0.3 * torch.randn_like(p))  # a draft that disagrees
    sft = build_drafter(DraftModelConfig(cut="first:2", divergence="sft"), target)
    sft.student.load_state_dict(fkl.student.state_dict())
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 64, (n,), generator=g).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)}
            for n in (7, 12)]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            p = torch.softmax(target.model(ids).logits[0], -1)
            q = torch.softmax(fkl.student(ids).logits[0], -1)
            for t in range(len(row["input_ids"]) - 1):
                if row["loss_mask"][t + 1]:  # position t predicts token t+1
                    total += 1 - 0.5 * float((p[t] - q[t]).abs().sum())
                    count += 1
    accuracies, measured = held_out(fkl, target, rows)
    sft_accuracies, sft_measured = held_out(sft, target, rows)
    assert measured["beta"] == pytest.approx(total / count, abs=1e-5) and total / count < 0.95
    assert sft_measured["beta"] == pytest.approx(total / count, abs=1e-5)
    assert sft_accuracies == pytest.approx(accuracies)  # top-1 against the target's choice on both


@pytest.mark.parametrize("divergence,temperature", [("fkl", 1.0), ("jsd", 2.0), ("sft", 1.0)])
def test_the_lm_head_and_the_loss_run_at_the_trained_positions_alone_and_equal_the_loss_over_all(divergence,
                                                                                                   temperature):
    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="first:2", divergence=divergence, temperature=temperature), target)
    batch = batch_of()
    batch["loss_mask"][1, 12:] = 0  # a row that ends early, as padding does
    seen = []
    hook = drafter.student.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    outputs = run_target(target, batch, drafter.held_out_needs())
    out = drafter.training_step(batch, outputs)
    hook.remove()
    weight = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))
    assert seen == [int(weight.sum())] == [out.counted[0]]  # position t predicts token t + 1
    out.loss.backward()
    mine = [p.grad.clone() for p in drafter.student.parameters()]
    drafter.student.zero_grad()
    logits = drafter.student(input_ids=batch["input_ids"], use_cache=False).logits  # every position, as before
    if divergence == "sft":
        labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
        per = -losses.log_probs(logits, temperature).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    else:
        per = losses.per_position(divergence, losses.log_probs(logits, temperature),
                                  losses.log_probs(outputs.logits, temperature))
    everywhere = losses.masked_mean(per, weight)
    everywhere.backward()
    assert float(out.loss) == pytest.approx(float(everywhere), rel=1e-5)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(mine, drafter.student.parameters()))
    acceptance = 1 - losses.per_position("tvd", losses.log_probs(logits), losses.log_probs(outputs.logits))
    assert out.metrics["acceptance"] == pytest.approx(float(losses.masked_mean(acceptance, weight)), rel=1e-5)


def test_gradients_reach_only_the_student():
    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="first:2", divergence="jsd"), target)
    batch = batch_of()
    drafter.training_step(batch, run_target(target, batch, drafter.needs())).loss.backward()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.student.parameters() if p.requires_grad)
    target_ids = {id(p) for p in target.model.parameters()}
    assert not any(id(p) in target_ids for p in drafter.parameters())


def test_a_teacher_cache_keeps_the_top_k_and_gives_the_same_loss_when_k_is_the_vocab(tmp_path):
    import datasets

    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="first:2", teacher_top_k=64), target)
    batch = batch_of(rows=1)
    rows = datasets.Dataset.from_list([{"input_ids": batch["input_ids"][0].tolist()}])
    for k in (64, 8):
        needs = TargetNeeds(logits=True, logits_top_k=k)
        cache = write_feature_cache(target, rows, needs, tmp_path / f"top{k}", split_fingerprint="s", dtype=torch.float32)
        cached = FeatureCache(cache, target, needs, "s").outputs({**batch, "row_index": torch.tensor([0])})
        assert cached.logits is None and cached.top_k.ids.shape == (1, 16, k)
        drafter.config = drafter.config.model_copy(update={"teacher_top_k": k})
        online = drafter.training_step(batch, run_target(target, batch, TargetNeeds(logits=True)))
        offline = drafter.training_step(batch, cached)
        if k == 64:  # the whole vocabulary: the same loss
            assert float(offline.loss) == pytest.approx(float(online.loss), rel=1e-4)
        else:  # k tokens and a bucket for the rest: a coarser view, so never a larger KL (data processing)
            assert 0 < float(offline.loss) <= float(online.loss) + 1e-7
    with pytest.raises(DrafttrainError, match="holds the teacher's top-8 .* the recipe asks top-64"):
        FeatureCache(tmp_path / "top8", target, TargetNeeds(logits=True, logits_top_k=64), "s")


def test_the_on_policy_sampler_uses_the_students_current_weights():
    """The answers are the current student's own (greedy here): they equal its generate from each prompt, and
    change with its weights."""
    from drafttrain.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = Target("tiny", tiny_target(vocab=len(tokenizer)).model, tokenizer)
    drafter = build_drafter(DraftModelConfig(cut="first:2", on_policy=1.0, on_policy_max_new_tokens=6,
                                             on_policy_temperature=0.0), target)
    batch = batch_of(vocab=len(tokenizer), rows=2)

    def answers(new):
        return [ids[mask.bool()].tolist() for ids, mask in zip(new["input_ids"], new["loss_mask"])]

    def own_generate():
        out = []
        for row in batch["input_ids"]:
            generated = drafter.student.generate(input_ids=row[:5][None], max_new_tokens=6, do_sample=False,
                                                 pad_token_id=0, eos_token_id=[-1])
            out.append(generated[0, 5:].tolist())
        return out

    first = drafter.on_policy_batch(batch)
    assert [int(m.nonzero()[0]) for m in first["loss_mask"]] == [5, 5]  # prompt: up to the first trained token
    assert all(ids[:5].tolist() == row[:5].tolist() for ids, row in zip(first["input_ids"], batch["input_ids"]))
    assert answers(first) == own_generate()
    with torch.no_grad():
        for p in drafter.student.parameters():
            p.add_(torch.randn_like(p))
    second = drafter.on_policy_batch(batch)
    assert answers(second) == own_generate() and answers(second) != answers(first)


def test_an_on_policy_step_runs_the_target_once_on_the_students_own_answers():
    """Found beside TRL's GKD trainer: the target used to run on the loader's rows and then again on the on-policy
    answers that replaced them. The step now asks the draft first; the trainer's outputs are not computed."""
    from drafttrain.targets import load_tokenizer
    from drafttrain.training.trainer import TrainStep

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = Target("tiny", tiny_target(vocab=len(tokenizer)).model, tokenizer)
    calls = []

    class CountedForward(HFForward):  # the target's forward, counted
        def outputs(self, batch):
            calls.append(batch["input_ids"].shape)
            return super().outputs(batch)

    batch = batch_of(vocab=len(tokenizer), rows=2)
    for on_policy, expected in ((1.0, 0), (0.0, 1)):
        drafter = build_drafter(DraftModelConfig(cut="first:2", on_policy=on_policy, on_policy_max_new_tokens=4,
                                                 on_policy_temperature=0.0), target).train()
        calls.clear()
        out = TrainStep(drafter, target, CountedForward(target, drafter.needs()))(batch)
        assert len(calls) == expected and torch.isfinite(out.loss)
        assert ("on_policy_s" in out.metrics) == (on_policy == 1.0)


def test_token_filter_leaves_out_the_hardest_share():
    per = torch.tensor([[0.1, 5.0, 0.2, 3.0, 0.3]])
    weight = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    keep = keep_learnable(per, weight, 0.5)  # 4 trained tokens, the 2 hardest (5.0, 3.0) left out
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0, 1.0]]


def test_a_saved_draft_is_a_plain_hf_model_folder(tmp_path):
    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="first:2"), target)
    drafter.save_pretrained(tmp_path / "draft")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, drafter.student(ids).logits, atol=1e-6)
    loaded = load_drafter(tmp_path / "draft", target)
    assert loaded.kind == "draft_model" and loaded.config.cut == "first:2"


def test_a_student_with_another_tokenizer_is_refused_naming_the_first_differing_id():
    import copy

    from drafttrain.targets import check_same_tokenizer, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<|extra|>"], special_tokens=True)
    with pytest.raises(DrafttrainError, match=r"the first id that differs is 49152: None in the target, '<\|extra\|>'"):
        check_same_tokenizer(Target("t", None, tokenizer), Target("d", None, other))


def test_a_student_as_large_as_its_target_is_warned_about(caplog):
    target = tiny_target()
    with caplog.at_level(logging.WARNING):
        build_drafter(DraftModelConfig(cut="every:1"), target)
    assert "the draft model has" in caplog.text and "cannot make decoding faster" in caplog.text


@pytest.mark.parametrize("name", ["smollm2_distill.yaml", "distill_llama3.1_8b_to_1b.yaml", "distill_llama70b_to_1b.yaml"])
def test_distill_recipes_validate(name, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.draft.kind == "draft_model"
    if "llama" in name:
        assert recipe.training.hidden_states == "offline" and recipe.training.deepspeed  # a teacher cache, ZeRO


def test_resume_gives_the_same_losses(tmp_path):
    from trainer_helpers import reset_accelerate, straight_and_resumed, tiny_dataset, tiny_recipe

    from drafttrain.training.trainer import Trainer

    def trainer(folder, callbacks=None):
        reset_accelerate()
        target = tiny_target(vocab=128)
        torch.manual_seed(2)
        drafter = build_drafter(DraftModelConfig(cut="first:2", divergence="jsd", on_policy=0.0), target)
        return Trainer(tiny_recipe(folder, max_steps=4, save_every=2, batch_size=2), target, drafter,
                       tiny_dataset(16), callbacks=callbacks)

    straight, resumed = straight_and_resumed(trainer, tmp_path)
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], abs=1e-6)
    reset_accelerate()


@pytest.mark.slow
def test_distillation_end_to_end_on_smollm2_with_a_teacher_cache_and_on_policy_batches(tmp_path):
    import json

    from drafttrain.commands import main

    path = small_recipe(
        tmp_path, {"kind": "draft_model", "cut": "first:2", "divergence": "jsd", "teacher_top_k": 16,
                   "on_policy": 0.5, "on_policy_max_new_tokens": 8},
        training={"hidden_states": "offline", "max_steps": 4, "save_every": 2, "log_every": 1,
                  "learning_rate": 1e-4},
        eval={"num_prompts": 1, "max_new_tokens": 8, "depth": 2})
    assert main(["prepare", str(path), "--no-progress"]) == 0
    index = json.loads((tmp_path / "run" / "features" / "index.json").read_text())
    assert index["logits_top_k"] == 16 and index["layers"] == []  # the teacher's top-k only: no hidden states
    assert main(["train", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("on_policy_s" in r for r in records)  # on-policy batches ran, and their cost is logged
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004"
    metrics = json.loads((checkpoint / "eval.json").read_text())
    assert metrics["greedy_match"] == 1.0 and metrics["tau"] >= 1.0
    assert 0.0 < metrics["val_beta"] <= 1.0  # the held-out acceptance β, logged for every checkpoint
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.num_hidden_layers == 2
    # the run folder itself is a --draft for eval (its best checkpoint, loaded as a drafttrain draft)
    assert main(["eval", "--target", "smollm2-135m-instruct", "--draft", str(tmp_path / "run"), "--num-prompts", "1",
                 "--turns", "1", "--max-new-tokens", "8", "--depth", "2", "--out", str(tmp_path / "eval"),
                 "--no-progress"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["config"]["proposer"] == "draft_model" and report["overall"]["greedy_match"] == 1.0
    measured = report["config"]["draft"]  # the run's best checkpoint, its weights identified
    assert Path(measured["path"]).parent == tmp_path / "run" / "checkpoints" and len(measured["weights_sha256"]) == 64


def test_a_repeated_proposal_without_an_accept_proposes_the_same(smollm2):
    """--depth auto times proposals back to back on one state: the second must not find an empty input."""
    from drafttrain.config import DraftModelConfig
    from drafttrain.decoding.draft_model import DraftModelProposer
    from drafttrain.decoding.proposers import DraftRequest
    from drafttrain.decoding.trees import Chain
    from drafttrain.drafts import build_drafter
    from drafttrain.sampling import Sampling

    proposer = DraftModelProposer(smollm2, draft=build_drafter(DraftModelConfig(cut="first:3"), smollm2))
    prompt = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    proposer.prefill(prompt, None, torch.tensor([[smollm2.tokenizer.encode(" Paris")[0]]]))
    request = DraftRequest(Chain(4), Sampling(), torch.Generator().manual_seed(0))
    first = proposer.propose(request)
    second = proposer.propose(request)
    assert torch.equal(first.tokens, second.tokens) and first.tokens.shape == (1, 4)


def test_a_draft_vocabulary_computes_the_drafts_logits_on_its_rows_and_stays_lossless():
    from drafttrain.decoding import SpeculativeDecoder, StaticTree, build_proposer, plain_decode

    class Tokens:  # the same (dummy) tokenizer on both sides
        bos_token_id, eos_token_id, pad_token_id, unk_token_id, all_special_tokens = 0, None, None, None, []

        def get_vocab(self):
            return {f"t{i}": i for i in range(64)}

    target, draft = tiny_target(0, layers=2), tiny_target(1, layers=1)
    target.tokenizer = draft.tokenizer = Tokens()
    rows = torch.arange(0, 64, 2)
    whole = build_proposer("draft_model", target, draft=draft)
    narrow = build_proposer("draft_model", target, draft=draft, vocab=rows)
    prompt = torch.tensor([[1, 5, 9, 2, 7]])
    for proposer in (whole, narrow):
        proposer.prefill(prompt[:, :-1], None, prompt[:, -1:])
    with torch.no_grad():
        full, cut = whole._root_logits(), narrow._root_logits()
    assert torch.allclose(cut[rows], full[rows], atol=1e-5) and torch.isneginf(cut[1::2]).all()
    expected = plain_decode(target, prompt, 24).tokens
    for tree in ("chain", StaticTree([[0], [1], [0, 0], [1, 0]])):
        assert SpeculativeDecoder(target, narrow, depth=3, tree=tree).generate(prompt, 24).tokens == expected
    with pytest.raises(DrafttrainError, match="names token 64"):
        build_proposer("draft_model", target, draft=draft, vocab=torch.tensor([3, 64]))


def test_a_distilled_draft_keeps_its_draft_vocabulary_beside_a_plain_hf_folder(tmp_path):
    from drafttrain.decoding import build_proposer

    target = tiny_target()
    rows = torch.tensor([0, 3, 4, 10, 63])
    drafter = build_drafter(DraftModelConfig(cut="first:2", draft_vocab=str(draft_vocab_file(tmp_path, rows, 64))),
                            target)
    assert torch.equal(drafter.serving_vocab, rows)
    drafter.save_pretrained(tmp_path / "draft")
    assert sorted(p.name for p in (tmp_path / "draft").glob("*.safetensors")) == ["model.safetensors"]
    loaded = load_drafter(tmp_path / "draft", target)
    assert torch.equal(loaded.serving_vocab, rows)
    assert torch.equal(build_proposer("draft_model", target, draft=loaded).rows, rows)
    assert build_proposer("draft_model", target, draft=loaded, vocab=False).rows is None
    AutoModelForCausalLM.from_pretrained(tmp_path / "draft")  # still a plain HF folder
    assert build_drafter(DraftModelConfig(cut="first:2"), target).serving_vocab is None  # no vocab: the whole


@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd", "tvd", "sft"])
def test_a_loss_over_the_draft_vocabulary_is_the_divergence_on_its_rows(tmp_path, divergence):
    """loss_vocab: draft takes the divergence between the student's and the target's logits at the draft
    vocabulary's rows (both renormalised over them), at positions whose target argmax (sft: label) is one of them;
    the student's other lm_head rows get no gradient."""
    from drafttrain.drafts import losses

    target = tiny_target()
    rows = torch.arange(0, 64, 2)
    drafter = build_drafter(DraftModelConfig(cut="first:2", divergence=divergence, loss_vocab="draft",
                                             draft_vocab=str(draft_vocab_file(tmp_path, rows, 64))), target)
    with torch.no_grad():
        for p in drafter.student.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batch = batch_of()
    needs = drafter.needs()
    assert divergence == "sft" or torch.equal(needs.logits_rows, rows)
    out = drafter.training_step(batch, run_target(target, batch, needs))
    out.loss.backward()
    with torch.no_grad():
        q = drafter.student(batch["input_ids"]).logits[..., rows]
        full_p = target.model(batch["input_ids"]).logits
        weight = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))
        if divergence == "sft":
            labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
            weight = weight * (labels % 2 == 0)
            want = losses.cross_entropy(q, (labels // 2), weight)
        else:
            weight = weight * (full_p.argmax(-1) % 2 == 0)
            want = losses.divergence(divergence, q, full_p[..., rows], weight)
    assert 0 < weight.sum() < batch["loss_mask"].sum()  # some positions are left out, some trained
    assert float(out.loss.detach()) == pytest.approx(float(want), rel=1e-5)
    assert not drafter.student.config.tie_word_embeddings
    head = drafter.student.get_output_embeddings().weight.grad
    assert head[1::2].abs().sum() == 0 and head[0::2].abs().sum() > 0


def test_a_student_equal_to_its_target_has_zero_loss_over_the_draft_vocabulary(tmp_path):
    target = tiny_target()
    drafter = build_drafter(DraftModelConfig(cut="every:1", loss_vocab="draft",
                                             draft_vocab=str(draft_vocab_file(tmp_path, range(0, 64, 3), 64))), target)
    batch = batch_of()
    out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
    assert float(out.loss) == pytest.approx(0.0, abs=1e-5)
    assert out.metrics["acceptance"] == pytest.approx(1.0, abs=1e-5) and out.correct == out.counted


def test_a_loss_over_the_draft_vocabulary_needs_one_and_keeps_the_teacher_cache_recomputable(tmp_path):
    target = tiny_target()
    with pytest.raises(DrafttrainError, match="loss_vocab: draft needs a draft vocabulary"):
        build_drafter(DraftModelConfig(cut="first:2", loss_vocab="draft"), target)
    config = DraftModelConfig(cut="first:2", loss_vocab="draft", draft_vocab=str(draft_vocab_file(tmp_path, [1, 2, 3], 64)))
    drafter = build_drafter(config, target)
    needs = type(drafter).target_needs(config, target)
    assert needs.logits_top_k is None and needs.stored_layers(4) == [4]  # an offline cache keeps the final hidden
    hf = codecs_of(type(drafter))["hf"]
    assert "draft vocabulary only" in hf.write(drafter).notes[0]  # the model card says how to serve it
    assert hf.write(build_drafter(DraftModelConfig(cut="first:2"), target)).notes == []


def test_on_policy_answers_over_the_draft_vocabulary_use_only_its_tokens(tmp_path):
    from drafttrain.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    vocab = len(tokenizer)
    target = Target("tiny", tiny_target(vocab=vocab).model, tokenizer)
    rows = torch.arange(0, vocab, 7)
    drafter = build_drafter(DraftModelConfig(cut="first:2", on_policy=1.0, on_policy_max_new_tokens=12,
                                             loss_vocab="draft", draft_vocab=str(draft_vocab_file(tmp_path, rows, vocab))),
                            target)
    batch = batch_of(vocab=vocab, rows=2)
    answered = drafter.on_policy_batch(batch)
    tokens = answered["input_ids"][answered["loss_mask"].bool()]
    assert tokens.numel() > 0 and bool((tokens % 7 == 0).all())
