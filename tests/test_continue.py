"""Continued training (``draft.init_from``), draft LoRA (``draft.draft_lora``) and replay (``data.replay``): a saved
draft trains on from its own weights with its own architecture, resumes after a crash exactly as a fresh run does,
adapts through LoRA adapters that are saved merged, and an earlier run's rows are mixed in as they were tokenised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from peft import LoraConfig, get_peft_model
from trainer_helpers import (  # noqa: F401 (fresh_accelerate: a fixture)
    VOCAB,
    Interrupted,
    fresh_accelerate,
    prepared_run,
    reset_accelerate,
    tiny_dataset,
    tiny_target,
)

import drafttrain.runs.train as train_command
from drafttrain import DrafttrainError
from drafttrain.config import DraftModelConfig, MedusaConfig, ReplayConfig, TargetLora, parse_recipe
from drafttrain.data.replay import with_replay
from drafttrain.data.tokenize import split_fingerprint
from drafttrain.data.vocab import DraftVocab, DraftVocabKey, build_mapping, save_draft_vocab
from drafttrain.drafts import load_drafter, start_drafter
from drafttrain.drafts.continuation import check_vocabulary_choice, continued_config, resolve_draft
from drafttrain.evaluation.report import _config_line
from drafttrain.runfolder import WEIGHTS_NAME, DataManifest, RunFolder, read_safetensors
from drafttrain.targets import load_target
from drafttrain.training.footprint import _draft_section as draft_section
from drafttrain.training.prepare import prepare

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

HEAD = {"kind": "eagle3", "ttt_steps": 2, "layers": [0, 1]}


def recipe_for(folder: Path, draft: dict, **training):
    return parse_recipe({"output_dir": str(folder), "draft": draft, "wandb": {"enabled": False},
                         "eval": {"every_checkpoint": False},
                         "training": {"batch_size": 4, "save_every": 2, "log_every": 1, "learning_rate": 1e-2,
                                      **training}})


def trained_head(folder: Path, steps: int = 3) -> Path:
    """A general head: trained a few steps on one data set, its run folder returned."""
    result = train_command.train(recipe_for(prepared_run(folder, tiny_dataset(16)), HEAD, max_steps=steps),
                                 target=tiny_target())
    reset_accelerate()
    return result.last_checkpoint


def test_a_continued_draft_starts_from_the_saved_weights_with_its_own_architecture(tmp_path):
    saved = trained_head(tmp_path / "general")
    # the recipe names only the kind and a training setting: layers and the rest come from the saved draft
    section = recipe_for(tmp_path / "new", {"kind": "eagle3", "init_from": str(tmp_path / "general"),
                                            "ttt_steps": 3}).draft
    drafter = start_drafter(section, tiny_target())
    assert drafter.config.ttt_steps == 3 and drafter.config.layers == [0, 1] and drafter.training
    weights, _ = read_safetensors(saved / WEIGHTS_NAME)
    for name, tensor in drafter.state_tensors().items():
        assert torch.equal(tensor, weights[name]), name

    result = train_command.train(recipe_for(prepared_run(tmp_path / "new", tiny_dataset(16, seed=1)),
                                            {"kind": "eagle3", "init_from": str(saved)}, max_steps=2),
                                 target=tiny_target())
    config = json.loads((result.last_checkpoint / "config.json").read_text())["drafttrain"]["draft"]
    assert config["init_from"] == str(saved) and config["layers"] == [0, 1]
    moved = load_drafter(result.last_checkpoint, tiny_target()).state_tensors()
    assert any(not torch.equal(moved[name], weights[name]) for name in weights)  # it trained from there


def test_a_continued_draft_trains_in_fp32_beside_a_half_precision_target(tmp_path):
    saved = trained_head(tmp_path / "general")
    half = tiny_target()
    half.model.to(torch.bfloat16)
    section = recipe_for(tmp_path / "new", {"kind": "eagle3", "init_from": str(saved),
                                            "draft_lora": {"rank": 4}}).draft
    drafter = start_drafter(section, half)  # AdamW on bf16 weights would lose updates below bf16's resolution
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}


def test_a_continued_draft_refuses_another_architecture_kind_or_vocabulary(tmp_path):
    trained_head(tmp_path / "general")
    prepared_run(tmp_path / "new", tiny_dataset(16))
    where = str(tmp_path / "general")
    with pytest.raises(DrafttrainError, match=r"draft.layers is \[0\] in the recipe, \[0, 1\] in the draft"):
        train_command.check_trainable(recipe_for(tmp_path / "new", {**HEAD, "layers": [0], "init_from": where}))
    with pytest.raises(DrafttrainError, match="holds a eagle3 draft; the recipe trains a dflash draft"):
        train_command.check_trainable(recipe_for(tmp_path / "new", {"kind": "dflash", "init_from": where}))
    with pytest.raises(DrafttrainError, match="no draft checkpoint|not found|no checkpoint"):
        train_command.check_trainable(recipe_for(tmp_path / "new", {**HEAD, "init_from": str(tmp_path / "nope")}))
    medusa2 = MedusaConfig(target_lora=TargetLora(target_modules=["q_proj"]))  # its adapters load merged
    with pytest.raises(DrafttrainError, match="Medusa-2 draft .* is not continued yet"):
        continued_config(medusa2, MedusaConfig(), "runs/m")
    with pytest.raises(DrafttrainError, match="trained through LoRA adapters .* is not continued yet"):
        continued_config(DraftModelConfig(cut="first:2", draft_lora={"target_modules": ["q_proj"]}),
                         DraftModelConfig(cut="first:2"), "runs/d")
    with pytest.raises(DrafttrainError, match="draft_lora adapts a trained draft"):
        parse_recipe({"draft": {**HEAD, "draft_lora": {"rank": 4}}})
    with pytest.raises(DrafttrainError, match="a eagle draft keeps the draft vocabulary .* draft_vocab.enabled: false"):
        check_vocabulary_choice(parse_recipe({"draft": {"kind": "eagle", "init_from": where}}).draft, True)


def _vocab_file(run: Path, ids: list[int]) -> None:
    """The run's draft vocabulary over target ids ``ids``, as prepare writes it."""
    d2t, t2d = build_mapping(torch.tensor(sorted(ids)), VOCAB)
    vocab = DraftVocab(d2t, t2d, DraftVocabKey("data", "tok"), 1.0, 1, len(ids))
    save_draft_vocab(vocab, RunFolder.of(run).draft_vocab)


def test_a_continued_head_drafts_over_a_vocabulary_chosen_on_the_new_data(tmp_path):
    """The rows of the tokens both vocabularies hold carry over as trained; a new token's row starts as the target's
    own output row; without the recipe asking, the saved vocabulary is kept."""
    general = tmp_path / "general"
    _vocab_file(general, list(range(0, 64)))
    result = train_command.train(recipe_for(prepared_run(general, tiny_dataset(16)), {**HEAD}, max_steps=2),
                                 target=tiny_target())
    reset_accelerate()
    old = load_drafter(result.last_checkpoint, tiny_target())
    assert old.d2t.numel() == 64
    new_ids = list(range(32, 112))  # 32 kept (32..63), 48 new, 32 dropped
    _vocab_file(prepared_run(tmp_path / "new", tiny_dataset(16, seed=1)), new_ids)
    section = recipe_for(tmp_path / "new", {"kind": "eagle3", "init_from": str(general)}).draft
    target = tiny_target()
    drafter = start_drafter(section, target, RunFolder.of(tmp_path / "new"), new_vocabulary=True)
    assert drafter.draft_to_target.tolist() == new_ids and drafter.t2d.sum() == len(new_ids)
    rows, old_rows = drafter.lm_head.weight, old.lm_head.weight
    assert torch.equal(rows[:32], old_rows[32:64])  # the kept tokens' trained rows
    assert torch.equal(rows[32:], target.model.get_output_embeddings().weight[64:112])  # the new ones: the target's
    assert not torch.equal(old_rows[32:64], target.model.get_output_embeddings().weight[32:64])  # (they trained)
    kept = start_drafter(section, target, RunFolder.of(tmp_path / "new"))
    assert kept.draft_to_target.tolist() == list(range(64))


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["whole", "lora"])
def test_continued_training_resumes_after_a_crash_exactly_as_an_uninterrupted_run(tmp_path, monkeypatch, lora):
    saved = trained_head(tmp_path / "general")
    draft = {"kind": "eagle3", "init_from": str(saved), "draft_lora": lora}
    straight = train_command.train(recipe_for(prepared_run(tmp_path / "straight", tiny_dataset(16, seed=1)), draft,
                                              max_steps=4),
                                   target=tiny_target())
    reset_accelerate()

    def crash_at_2(step, checkpoint):
        if step == 2:
            raise Interrupted

    monkeypatch.setattr(train_command, "checkpoint_callbacks", lambda *args: [crash_at_2])
    recipe = recipe_for(prepared_run(tmp_path / "crashed", tiny_dataset(16, seed=1)), draft, max_steps=4)
    with pytest.raises(Interrupted):
        train_command.train(recipe, target=tiny_target())
    reset_accelerate()
    monkeypatch.setattr(train_command, "checkpoint_callbacks", lambda *args: [])
    resumed = train_command.train(recipe, resume=True, target=tiny_target())
    assert resumed.resumed_from.name == "step-000002" and sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], rel=0, abs=1e-6)
    a, _ = read_safetensors(straight.last_checkpoint / WEIGHTS_NAME)
    b, _ = read_safetensors(resumed.last_checkpoint / WEIGHTS_NAME)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def test_draft_lora_trains_only_its_adapters_and_saves_the_head_merged(tmp_path):
    saved = trained_head(tmp_path / "general")
    section = recipe_for(tmp_path / "new", {"kind": "eagle3", "init_from": str(saved),
                                            "draft_lora": {"rank": 4, "alpha": 8}}).draft
    drafter = start_drafter(section, tiny_target())
    trainable = [name for name, p in drafter.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert not any("lm_head" in name for name in trainable)  # the output layer is not adapted by default
    with torch.no_grad():  # adapters that have learnt something (B starts at zero)
        for name, p in drafter.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    merged = drafter.state_tensors()
    plain = load_drafter(saved, tiny_target()).state_tensors()
    assert merged.keys() == plain.keys()  # the kind's own layout: engines and exports read it as any head
    x = torch.randn(3, drafter.fc.in_features)
    assert torch.allclose(drafter.fc(x), x @ merged["fc.weight"].T, atol=1e-5)  # merged = what the adapters compute
    assert not torch.equal(merged["fc.weight"], plain["fc.weight"])
    assert torch.equal(merged["lm_head.weight"], plain["lm_head.weight"])

    with pytest.raises(DrafttrainError, match=r"draft_lora.target_modules \['nope'\] are not modules"):
        start_drafter(section.model_copy(update={"draft_lora": section.draft_lora.model_copy(
            update={"target_modules": ["nope"]})}), tiny_target())


def tokenised_rows(rows: int, seed: int):
    """Rows as prepare writes them: with their lengths."""
    dataset = tiny_dataset(rows, seed=seed)
    return dataset.add_column("num_tokens", [len(ids) for ids in dataset["input_ids"]])


def test_replay_appends_an_earlier_runs_rows_as_they_were_tokenised(tmp_path):
    old, old_rows = tmp_path / "general", tokenised_rows(40, seed=0)
    old_rows.save_to_disk(str(old / "data" / "train"))
    (old / "data" / "manifest.json").write_text(json.dumps({"train": split_fingerprint(old_rows),
                                                             "tokenizer": "tok-A"}))
    new, replay = tokenised_rows(12, seed=5), ReplayConfig(run=str(old), fraction=0.25)

    mixed, stats = with_replay(new, replay, "tok-A", max_length=14, seed=0)
    too_long = sum(n > 14 for n in old_rows["num_tokens"])
    assert stats["asked"] == 4 and stats["rows"] == 4 and stats["too_long"] == too_long > 0
    assert mixed["input_ids"][:12] == new["input_ids"]
    assert set(mixed["id"][12:]) <= set(old_rows["id"]) and all(n <= 14 for n in mixed["num_tokens"][12:])
    again, _ = with_replay(new, replay, "tok-A", max_length=14, seed=0)
    assert again["id"] == mixed["id"]  # the seed fixes which rows

    with pytest.raises(DrafttrainError, match="another tokenizer"):
        with_replay(new, replay, "tok-B", max_length=14, seed=0)
    # every row already here: that is the cause named, not a length every row fits
    with pytest.raises(DrafttrainError, match=r"nothing to replay of its 40 rows: 40 are already in this run's data \("):
        with_replay(old_rows, replay, "tok-A", max_length=1000, seed=0)
    with pytest.raises(DrafttrainError, match="no prepared data there"):
        with_replay(new, ReplayConfig(run=str(tmp_path / "nothing"), fraction=0.25), "tok-A", 14, 0)
    tokenised_rows(40, seed=9).save_to_disk(str(tmp_path / "other"))  # the split changed after its prepare
    (old / "data" / "train").rename(tmp_path / "moved")
    (tmp_path / "other").rename(old / "data" / "train")
    with pytest.raises(DrafttrainError, match="does not hash to the fingerprint"):
        with_replay(new, replay, "tok-A", max_length=14, seed=0)


@pytest.mark.slow
def test_prepare_replays_an_earlier_run_into_the_split_that_train_checks(tmp_path, repo_data):
    def raw(name: str, source: str, **data) -> dict:
        return {"output_dir": str(tmp_path / name), "target": {"model": "smollm2-135m-instruct"},
                "data": {"sources": [{"path": str(repo_data / "data" / "train" / source)}], "num_samples": 8,
                         "validation_fraction": 0.25, "max_length": 512, **data}}

    prepare(parse_recipe(raw("general", "gpteacher_roleplay.json")), progress=False, show_summary=False)
    result = prepare(parse_recipe(raw("math", "gsm8k_train.jsonl",
                                      replay={"run": str(tmp_path / "general"), "fraction": 0.5})),
                     progress=False, show_summary=False)
    replay = result.summary["replay"]
    assert replay["asked"] == 6 and replay["rows"] == 6 and result.train_rows == 12
    ids = load_from_disk(str(tmp_path / "math" / "data" / "train"))["conversation_id"]
    assert sum(i.startswith("gpteacher_roleplay:") for i in ids) == 6 and sum(i.startswith("gsm8k") for i in ids) == 6
    validation = load_from_disk(str(tmp_path / "math" / "data" / "validation"))["conversation_id"]
    assert all(i.startswith("gsm8k") for i in validation)  # held out: the new domain only
    # the split train opens is the one the manifest records, replayed rows included
    train = load_from_disk(str(tmp_path / "math" / "data" / "train"))
    assert DataManifest.read(RunFolder.of(tmp_path / "math")).train == split_fingerprint(train)


@pytest.mark.slow
def test_a_fine_tuned_target_given_as_a_lora_adapter_is_the_merged_model_under_its_own_name(tmp_path, smollm2):
    torch.manual_seed(0)
    tuned = get_peft_model(load_target("smollm2-135m-instruct").model, LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))  # random B: a real change
    tuned.save_pretrained(str(tmp_path / "lora"))
    spec = f"smollm2-135m-instruct+{tmp_path / 'lora'}"
    target = load_target(spec)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = tuned(input_ids=ids).logits
        # merged weights against the adapter computed beside them: fp32 rounding (logits of size ~30) apart
        assert torch.allclose(target.model(input_ids=ids).logits, expected, rtol=0, atol=3e-3)
        assert not torch.allclose(smollm2.model(input_ids=ids).logits, expected, atol=1e-2)
    assert target.name == f"smollm2-135m-instruct+{(tmp_path / 'lora').resolve()}"
    assert load_target(target.name).fingerprint == target.fingerprint != smollm2.fingerprint  # the name reloads it
    assert target.tokenizer_fingerprint == smollm2.tokenizer_fingerprint  # a head of the base loads on it

    config = {"target": target.name, "draft": {"trained_for": "smollm2-135m-instruct"}, "proposer": "eagle3",
              "tree": "chain", "depth": 3, "temperature": 0, "top_p": 1, "suite": "s", "num_prompts": 1,
              "num_turns": 1, "max_new_tokens": 8, "seed": 0, "dtype": "float32", "device": "cpu", "threads": 1,
              "versions": {"torch": "t", "transformers": "t", "drafttrain": "d"}}
    assert "(the draft was trained for `smollm2-135m-instruct`)" in _config_line(config)
    with pytest.raises(DrafttrainError, match="not a peft adapter folder"):
        load_target(parse_recipe({"target": {"adapter": str(tmp_path)}}).target)


@pytest.mark.slow
def test_a_continued_run_killed_mid_training_resumes_to_the_uninterrupted_runs_losses(tmp_path, folder_target):
    """A head continued with draft LoRA by `drafttrain train`, killed (SIGKILL) once its step-3 checkpoint is written,
    then `--resume`: steps 4-6 give the losses of the continued run that was never interrupted."""
    from conftest import killed_and_straight_losses, small_recipe

    from drafttrain.commands import main

    general = tmp_path / "general"
    general.mkdir()
    head = {"kind": "eagle3", "ttt_steps": 2}
    training = {"batch_size": 2, "max_steps": 6, "save_every": 3, "log_every": 1}
    recipe = small_recipe(general, head, target={"model": str(folder_target)}, eval={"every_checkpoint": False},
                          training={**training, "max_steps": 2, "save_every": 2})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0 and main(["train", str(recipe)]) == 0
    recipes = {}
    for name in ("straight", "killed"):
        (tmp_path / name).mkdir()
        continued = {"kind": "eagle3", "init_from": str(general / "run"), "draft_lora": {"rank": 4}}
        recipes[name] = small_recipe(tmp_path / name, continued, target={"model": str(folder_target)},
                                     eval={"every_checkpoint": False}, training={**training, "learning_rate": 1e-3})
        assert main(["prepare", str(recipes[name]), "--no-progress"]) == 0
    losses = killed_and_straight_losses(recipes)
    assert sorted(losses["killed"]) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert losses["killed"][step] == pytest.approx(losses["straight"][step], rel=0, abs=1e-5)


def test_the_plan_stands_in_for_a_continued_heads_vocabulary_by_its_saved_size(tmp_path):
    general = tmp_path / "general"
    _vocab_file(general, list(range(0, 64)))
    train_command.train(recipe_for(prepared_run(general, tiny_dataset(16)), {**HEAD}, max_steps=1),
                        target=tiny_target())
    reset_accelerate()
    for enabled in (False, True):  # kept, or to be extended by a prepare not yet run: at least its own 64 tokens
        recipe = parse_recipe({"output_dir": str(tmp_path / "new"),
                               "draft": {"kind": "eagle3", "init_from": str(general)},
                               "draft_vocab": {"enabled": enabled}, "data": {"sources": [{"path": "x.jsonl"}]}})
        with draft_section(recipe, VOCAB, resolve_draft(recipe.draft)) as (draft, _):
            assert read_safetensors(Path(draft.draft_vocab))[0]["d2t"].numel() == 64


def test_a_continued_run_reads_its_saved_drafts_config_once(tmp_path):
    """The recipe's draft section is resolved once (drafts/continuation.py: ResolvedDraft) and passed to the checks,
    the plan and the start of training: the saved draft's config.json is opened once in the whole run."""
    import sys

    saved = trained_head(tmp_path / "general", steps=2)
    recipe = recipe_for(prepared_run(tmp_path / "new", tiny_dataset(16, seed=1)),
                        {"kind": "eagle3", "init_from": str(saved)}, max_steps=1)
    opened, config = [], str(saved / "config.json")

    def count(event, args):
        if event == "open" and args and isinstance(args[0], (str, Path)) and str(args[0]) == config:
            opened.append(1)

    sys.addaudithook(count)  # audit hooks stay for the process: it counts only that one file
    train_command.train(recipe, target=tiny_target())
    assert len(opened) == 1
