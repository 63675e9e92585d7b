"""Medusa heads: labels, training, Medusa-2's LoRA (what trains, what stays bit-identical), save/resume, the tree
proposer's losslessness, tree building, recipes and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, small_recipe
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain import DrafttrainError
from drafttrain.config import MedusaConfig, load_recipe, parse_recipe
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.decoding.trees import NAMED_TREES, StaticTree, build_static_tree, expected_tree_tokens
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.losses import cross_entropy
from drafttrain.targets import Target, run_target

LORA = {"target_modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8, "dropout": 0.0, "learning_rate": 1e-2}


def tiny_target(seed: int = 0, vocab: int = 64) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), None)


def batch_of(target, rows=2, seq=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, :4] = 0  # a prompt
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}


def test_head_i_learns_the_token_i_plus_2_ahead():
    """Each head's loss is the cross-entropy of its logits at t against the token at t+2+i, masked where that
    token is not trainable: recomputed here from the logits with the shift written out."""
    target = tiny_target()
    drafter = build_drafter(MedusaConfig(num_heads=3), target)
    batch = batch_of(target)
    with torch.no_grad():
        out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
        hidden = run_target(target, batch, drafter.needs()).final
        ids, mask = batch["input_ids"], batch["loss_mask"]
        for i in range(3):
            logits = drafter.lm_heads[i](drafter.blocks[i](hidden))[:, : -(2 + i)]
            want = cross_entropy(logits, ids[:, 2 + i :], mask[:, 2 + i :])
            assert out.metrics[f"loss_{i}"] == pytest.approx(float(want), rel=1e-5), i
            assert out.counted[i] == float(mask[:, 2 + i :].sum())


def test_a_fresh_head_is_the_targets_lm_head_and_its_blocks_pass_through():
    target = tiny_target()
    drafter = build_drafter(MedusaConfig(num_heads=2), target)
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(drafter.head_logits(hidden)[:, 0], target.model.lm_head(hidden), atol=1e-6)


def test_medusa2_trains_only_the_named_adapters_and_keeps_the_base_bit_identical(tmp_path):
    """LoRA on q_proj and v_proj only; the base weights never change; during the heads-only stage the adapters
    do not change either; with the adapters disabled the model computes exactly what the original did."""
    from trainer_helpers import reset_accelerate, tiny_dataset, tiny_recipe

    from drafttrain.training.trainer import Trainer

    reset_accelerate()
    target = tiny_target(vocab=128)
    base = {n: p.clone() for n, p in target.model.named_parameters()}
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        original = target.model(ids).logits
    drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=dict(LORA, heads_only_steps=2)), target)
    lora = drafter.trainable_target_parameters()
    assert lora and all(("q_proj" in n or "v_proj" in n) and "lora_" in n for n in lora)
    adapters = dict(target.model.named_parameters())
    recipe = tiny_recipe(tmp_path, max_steps=2, save_every=2)
    Trainer(recipe, target, drafter, tiny_dataset()).train()
    at_two = {n: adapters[n].clone() for n in lora}
    assert all(torch.equal(at_two[n], adapters[n]) for n in lora)  # heads only so far: no adapter moved
    reset_accelerate()
    Trainer(tiny_recipe(tmp_path, max_steps=4, save_every=2), target, drafter, tiny_dataset()).train(resume=True)
    assert any(not torch.equal(at_two[n], adapters[n]) for n in lora)  # then they train
    for name, param in target.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base[name.replace(".base_layer", "")]), name
    with torch.no_grad(), drafter.original_target():
        assert torch.equal(target.model(ids).logits, original)
    reset_accelerate()


def test_medusa2_sees_the_adapted_targets_own_logits_and_no_kl_while_its_adapters_are_fresh():
    """The target outputs a Medusa-2 step trains on come from the peft-wrapped target: its logits equal the adapted
    model's own forward (a wrapper once hid the decoder from the logits path, which then scored dummy input), and
    the KL to the original is zero until the adapters change."""
    target = tiny_target()
    drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=dict(LORA, dropout=0.0)), target)
    batch = batch_of(target)
    with torch.no_grad():
        assert drafter.training_step(batch, run_target(target, batch, drafter.needs())).metrics["loss_kl"] == 0.0
        for name, param in target.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
        outputs = run_target(target, batch, drafter.needs())
        own = target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.allclose(outputs.logits, own, atol=1e-5)
        assert drafter.training_step(batch, outputs).metrics["loss_kl"] > 0


def test_medusa2_checkpoint_round_trip_adapts_a_fresh_target(tmp_path):
    target = tiny_target(vocab=64)
    drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=dict(LORA, save_merged=True)), target)
    with torch.no_grad():
        for name, param in target.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # adapters that change the model
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        adapted = target.model(ids).logits
    drafter.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 2
    fresh = tiny_target(vocab=64)
    loaded = load_drafter(tmp_path / "ckpt", fresh)
    assert loaded.adapts_target
    with torch.no_grad():
        assert torch.allclose(fresh.model(ids).logits, adapted, atol=1e-5)
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt" / "merged")
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-5)
    for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_medusa_proposer_on_a_tiny_target_samples_exactly(monkeypatch):
    """The tree proposer in the χ² engine test of test_decoding_sampling: deterministic top-k candidates, so the
    verification's one-hot rule keeps the target's distribution."""
    from test_decoding_sampling import P_THRESHOLD, engine_pvalue

    def medusa(target):
        return build_proposer("medusa", target, draft=build_drafter(MedusaConfig(num_heads=2), target))

    assert engine_pvalue([[0], [1], [0, 0], [1, 0]], proposer=medusa) > P_THRESHOLD
    assert engine_pvalue("chain", proposer=medusa) > P_THRESHOLD


@pytest.mark.slow
def test_medusa_greedy_equals_target_greedy_on_smollm2(smollm2):
    """Heads overfitted on the target's own answer, then served through chains and trees: identical tokens."""
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "List three facts about the moon."}],
                                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    greedy = plain_decode(smollm2, prompt, 32).tokens
    torch.manual_seed(0)
    drafter = build_drafter(MedusaConfig(num_heads=3), smollm2).train()
    tokens = torch.tensor([prompt + greedy])
    batch = {"input_ids": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
             "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        outputs = run_target(smollm2, batch, drafter.needs())
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    for _ in range(10):  # measured: after 10 steps every tree below accepts 24 of the 32 tokens
        loss = drafter.training_step(batch, outputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    for tree in ("chain", NAMED_TREES["medusa-8"], [[0], [1], [0, 0], [0, 1], [0, 0, 0]]):
        proposer = build_proposer("medusa", smollm2, draft=drafter)
        out = SpeculativeDecoder(smollm2, proposer, depth=3, tree=tree).generate(prompt, 32)
        assert out.tokens == greedy
        assert sum(out.stats.accepted_per_step) > 8, out.stats.accepted_per_step


def test_a_tree_deeper_than_the_heads_is_refused():
    target = tiny_target()
    proposer = build_proposer("medusa", target, draft=build_drafter(MedusaConfig(num_heads=2), target))
    with pytest.raises(DrafttrainError, match="depth 3 is deeper than proposer 'medusa' can fill \\(2"):
        SpeculativeDecoder(target, proposer, depth=3)
    recipe = parse_recipe({"draft": {"kind": "medusa", "num_heads": 2}, "eval": {"tree": "medusa-16"}})
    from drafttrain.evaluation.checkpoint_eval import check_eval_shape

    with pytest.raises(DrafttrainError, match="deeper than this medusa draft can fill \\(2\\)"):
        check_eval_shape(recipe)


def test_a_lora_module_the_target_lacks_is_refused():
    with pytest.raises(DrafttrainError, match=r"target_modules \['qkv_proj'\] are not modules of tiny"):
        build_drafter(MedusaConfig(target_lora=dict(LORA, target_modules=["q_proj", "qkv_proj"])), tiny_target())


def test_medusa2_with_offline_hidden_states_is_refused_by_the_recipe():
    with pytest.raises(DrafttrainError, match="trains the target .* cannot be computed ahead"):
        parse_recipe({"draft": {"kind": "medusa", "target_lora": LORA}, "training": {"hidden_states": "offline"}})


def test_the_tree_builder_takes_the_likeliest_paths_and_keeps_trees_closed():
    accuracies = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.05], [0.4, 0.1, 0.05]]
    tree = build_static_tree(accuracies, 5)
    assert tree == [[0], [0, 0], [1], [1, 0], [0, 0, 0]]  # 0.6, 0.3, 0.25, 0.125, 0.12 (then [2] at 0.1)
    StaticTree(tree)  # ancestor- and sibling-closed
    assert expected_tree_tokens(tree, accuracies) == pytest.approx(1 + 0.6 + 0.3 + 0.25 + 0.125 + 0.12)
    # measured accuracies that are not monotone in rank still give a closed tree
    StaticTree(build_static_tree([[0.3, 0.5, 0.1], [0.2, 0.4, 0.3]], 6))
    for size in (4, 8, 16, 32, 64):
        assert len(StaticTree(NAMED_TREES[f"medusa-{size}"])) == size


@pytest.mark.parametrize("name", ["smollm2_medusa1.yaml", "smollm2_medusa2.yaml", "medusa2_llama3.1_8b.yaml"])
def test_medusa_recipes_validate(name, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.draft.kind == "medusa" and (recipe.draft.target_lora is not None) == ("medusa2" in name)


def test_medusa2_resume_restores_heads_adapters_and_optimizer(tmp_path):
    from trainer_helpers import reset_accelerate, straight_and_resumed, tiny_dataset, tiny_recipe

    from drafttrain.training.trainer import Trainer

    def trainer(folder, callbacks=None):
        reset_accelerate()
        target = tiny_target(vocab=128)
        torch.manual_seed(3)  # the same heads and adapters at the start of both runs
        drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=dict(LORA, heads_only_steps=1)), target)
        recipe = tiny_recipe(folder, max_steps=4, save_every=2, batch_size=2)
        return Trainer(recipe, target, drafter, tiny_dataset(16), callbacks=callbacks)

    straight, resumed = straight_and_resumed(trainer, tmp_path)
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], abs=1e-6)
    a = load_drafter(straight.last_checkpoint, tiny_target(vocab=128))
    b_target = tiny_target(vocab=128)
    b = load_drafter(resumed.last_checkpoint, b_target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), name
    lora_a = {n: p for n, p in a.target.model.named_parameters() if "lora_" in n}
    lora_b = {n: p for n, p in b_target.model.named_parameters() if "lora_" in n}
    assert lora_a and all(torch.allclose(lora_a[n], lora_b[n], atol=1e-6) for n in lora_a)
    reset_accelerate()


@pytest.mark.slow
def test_medusa2_trains_and_every_checkpoint_reports_its_drift_from_the_original(tmp_path):

    from drafttrain.commands import main

    path = small_recipe(
        tmp_path, {"kind": "medusa", "num_heads": 2, "target_lora": dict(LORA, learning_rate=1e-3, heads_only_steps=1)},
        draft_vocab={"enabled": True, "size": 512},
        training={"max_steps": 4, "save_every": 2, "log_every": 1, "learning_rate": 1e-3},
        eval={"num_prompts": 1, "max_new_tokens": 8, "depth": 2, "tree": "medusa-4"})
    assert main(["prepare", str(path), "--no-progress"]) == 0
    assert main(["train", str(path)]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    metrics = json.loads((checkpoint / "eval.json").read_text())
    assert {"tau", "greedy_match", "target_perplexity", "original_perplexity", "greedy_match_vs_original"} <= set(metrics)
    assert metrics["greedy_match"] == 1.0  # lossless against the adapted target
    report = json.loads((checkpoint / "eval" / "report.json").read_text())
    assert report["config"]["proposer"] == "medusa" and report["config"]["tree"]["kind"] == "static"


@pytest.mark.slow
def test_tree_auto_sizes_a_tree_from_the_drafts_measured_accuracies(smollm2, restore_threads):
    from drafttrain.decoding.autodepth import TREE_SIZES
    from drafttrain.evaluation import evaluate, load_suite

    torch.set_num_threads(1)
    drafter = build_drafter(MedusaConfig(num_heads=3), smollm2)
    reported = load_suite("mt_bench").select(1, turns="1")
    calibration = load_suite("alpaca").select(2).questions
    report = evaluate(smollm2, drafter, reported, tree="auto", calibration=calibration, max_new_tokens=8,
                      progress=False, warmup=False)
    auto = report.config["tree_auto"]
    assert auto["size"] in TREE_SIZES and set(auto["predicted_speedup_by_size"]) == set(TREE_SIZES)
    assert len(auto["top1_accuracy_by_depth"]) == 3 and report.greedy_match == 1.0
    best = max(auto["predicted_speedup_by_size"].values())
    assert auto["predicted_speedup"] == best and auto["plain_decoding"] == (best < 1.0)
    if auto["plain_decoding"]:  # no tree pays here (an untrained head usually): plain decoding, not a slowdown
        assert report.config["tree"] == "chain" and "(tree auto: plain decoding)" in report.config["proposer"]
        assert report.overall["tau"] == 1.0
    else:
        assert report.config["tree"]["kind"] == "static" and len(report.config["tree"]["paths"]) == auto["size"]


@pytest.mark.slow
def test_trained_drafts_share_a_run_with_their_own_shapes_but_a_target_adapter_cannot(smollm2, restore_threads):
    from drafttrain.config import DecodeSettings
    from drafttrain.cpu_linear import PackedLinears
    from drafttrain.evaluation import evaluate, load_suite
    from drafttrain.evaluation.sides import Compared, SideBuilder

    torch.set_num_threads(1)
    medusa = build_drafter(MedusaConfig(num_heads=2), smollm2)
    report = evaluate(smollm2, "prompt_lookup", load_suite("gsm8k").select(1), depth=3, max_new_tokens=8,
                      progress=False, warmup=False, compare=[Compared(medusa, tree=NAMED_TREES["medusa-4"],
                                                                      label="medusa-untrained")])
    line = report.comparisons["medusa-untrained"]
    assert line["greedy_match_vs_baseline"] == 1.0 and line["tau"] >= 1.0
    described = report.config["compare"][0]
    assert described["proposer"] == "medusa" and described["tree"]["kind"] == "static"
    adapted = tiny_target(vocab=64)
    adapter = build_drafter(MedusaConfig(num_heads=2, target_lora=LORA), adapted)
    with pytest.raises(DrafttrainError, match="adapts its target cannot share a run"):
        settings = DecodeSettings.of(depth=2, max_depth=4, max_new_tokens=8)
        SideBuilder(adapted, settings, (), [], PackedLinears(mode="default")).compared(Compared(adapter))


def test_eval_of_medusa2_reports_how_far_the_adapted_target_moved_from_the_original(smollm2):
    """The evaluator verifies against the adapted target and adds plain decoding with the adapters off on the same
    prompts: with fresh adapters (LoRA B = 0) the two agree on every prompt; with adapters that change the model
    they do not, and speculative decoding is still lossless against the adapted target."""
    from drafttrain.evaluation import evaluate, load_suite
    from drafttrain.evaluation.report import render_markdown

    torch.manual_seed(0)  # a tiny random model with SmolLM2's tokenizer, so prompts render; its own peft wrapper
    config = LlamaConfig(vocab_size=smollm2.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    target = Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), smollm2.tokenizer)
    drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=LORA), target).eval()
    prompts = load_suite("gsm8k").select(2, turns="1")
    fresh = evaluate(target, drafter, prompts, tree=NAMED_TREES["medusa-4"], max_new_tokens=12, progress=False,
                     warmup=False)
    assert fresh.original_target["greedy_match_vs_baseline"] == 1.0
    assert fresh.original_target["method_speedup_vs_original"] > 0
    with torch.no_grad():
        for name, param in target.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 2.0)
    moved = evaluate(target, drafter, prompts, tree=NAMED_TREES["medusa-4"], max_new_tokens=12, progress=False,
                     warmup=False)
    assert moved.original_target["greedy_match_vs_baseline"] == 0.0
    assert moved.greedy_match == 1.0
    assert "adapted vs original" in render_markdown(moved)
    plain = evaluate(target, "prompt_lookup", prompts, max_new_tokens=4, progress=False, warmup=False)
    assert plain.original_target is None  # only a draft that adapts its target gets the line


@pytest.mark.slow
def test_eval_of_a_medusa_draft_defaults_to_a_depth_its_heads_can_fill(tmp_path, smollm2, capsys, restore_threads):
    """`drafttrain eval --draft MEDUSA` with no --depth used the default depth 5 and failed after loading everything
    on a 3-head draft: a default now fits the draft, while a depth the user gives is still refused, naming both."""
    from conftest import draft_vocab_file

    from drafttrain.commands import main

    vocab = draft_vocab_file(tmp_path, range(64), smollm2.vocab_size)
    build_drafter(MedusaConfig(num_heads=3, draft_vocab=str(vocab)), smollm2).save_pretrained(tmp_path / "medusa")
    common = ["eval", "--target", "smollm2-135m-instruct", "--draft", str(tmp_path / "medusa"), "--num-prompts", "1",
              "--turns", "1", "--max-new-tokens", "4", "--threads", "1", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "default")]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "default" / "report.json").read_text())["config"]["depth"] == 3
    assert main([*common, "--depth", "5", "--out", str(tmp_path / "deep")]) == 2
    assert "depth 5 is deeper than proposer 'medusa' can fill (3" in capsys.readouterr().err
