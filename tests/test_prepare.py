"""``drafttrain prepare``: CLI wiring, early errors, the demo recipe, and a tiny end-to-end run with real SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.config import load_recipe, parse_recipe
from drafttrain.training.prepare import check_data_files, prepare

REPO = Path(__file__).resolve().parents[1]


def write_recipe(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tiny_recipe(tmp_path: Path, repo_data: Path, **overrides) -> dict:
    raw = {
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "target": {"model": "smollm2-135m-instruct"},
        "data": {
            "sources": [
                {"path": str(repo_data / "data" / "train" / "gsm8k_train.jsonl"), "weight": 2},
                {"path": str(repo_data / "data" / "train" / "gpteacher_roleplay.json"), "weight": 1},
            ],
            "num_samples": 6,
            "validation_fraction": 0.2,
            "max_length": 512,
        },
        "regenerate": {"enabled": True, "max_new_tokens": 12, "batch_size": 8},
        "draft_vocab": {"enabled": True, "size": 512},
    }
    raw.update(overrides)
    return raw


def test_help_lists_the_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "recipe" in out and "--limit" in out and "key.sub=value" in out


def test_unknown_key_is_rejected_with_the_field_named(tmp_path, repo_data, capsys):
    raw = tiny_recipe(tmp_path, repo_data)
    raw["data"]["bogus_field"] = 1
    assert main(["prepare", str(write_recipe(tmp_path, raw))]) != 0
    err = capsys.readouterr().err
    assert "data.bogus_field" in err and "unknown key" in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_bad_override_type_is_rejected(tmp_path, repo_data, capsys):
    path = write_recipe(tmp_path, tiny_recipe(tmp_path, repo_data))
    assert main(["prepare", str(path), "regenerate.max_new_tokens=lots"]) != 0
    assert "regenerate.max_new_tokens" in capsys.readouterr().err


def test_missing_data_file_names_the_field(tmp_path, repo_data, capsys):
    raw = tiny_recipe(tmp_path, repo_data)
    raw["data"]["sources"][1]["path"] = "../nowhere/missing.jsonl"
    assert main(["prepare", str(write_recipe(tmp_path, raw))]) != 0
    err = capsys.readouterr().err
    assert "data.sources.1.path" in err and "missing.jsonl" in err and "current directory" in err


def test_draft_vocab_larger_than_the_target_vocab_fails_before_any_work(tmp_path, repo_data):
    recipe = parse_recipe(tiny_recipe(tmp_path, repo_data, draft_vocab={"enabled": True, "size": 60000}))
    with pytest.raises(DrafttrainError, match=r"60000.*49152"):
        prepare(recipe, show_summary=False)
    assert not (tmp_path / "run").exists()


def test_nothing_trainable_is_an_error_not_an_empty_dataset(tmp_path, repo_data):
    """Prompt-only questions without regeneration leave nothing to train on: a clear error with the reason."""
    raw = tiny_recipe(tmp_path, repo_data, regenerate={"enabled": False}, draft_vocab={"enabled": False})
    raw["data"]["sources"] = [{"path": str(repo_data / "eval" / "mt_bench.jsonl")}]
    with pytest.raises(DrafttrainError, match=r"train split: no conversation could be tokenised \(prompt-only"):
        prepare(parse_recipe(raw), show_summary=False)
    assert not (tmp_path / "run" / "data" / "train").exists()


def test_demo_recipe_is_valid_and_its_data_exists(monkeypatch):
    monkeypatch.chdir(REPO)  # its data paths are relative to the repository root
    recipe = load_recipe(REPO / "recipes" / "smollm2_prepare_demo.yaml")
    assert recipe.target.model == "smollm2-135m-instruct" and recipe.regenerate.enabled and recipe.draft_vocab.enabled
    assert recipe.draft_vocab.size == 8192 and recipe.data.max_length == 1024
    check_data_files(recipe.data)


@pytest.mark.slow
def test_prepare_end_to_end(tmp_path, repo_data, smollm2, capsys):
    from datasets import load_from_disk

    from drafttrain.data.tokenize import split_fingerprint, tokenizer_fingerprint
    from drafttrain.data.vocab import DraftVocabKey, load_draft_vocab

    recipe = parse_recipe(tiny_recipe(tmp_path, repo_data))
    result = prepare(recipe, target=smollm2, progress=False)
    out = tmp_path / "run"
    summary = json.loads((out / "prepare_summary.json").read_text())
    assert summary == result.summary
    assert "drafttrain prepare" in capsys.readouterr().out  # the table was printed

    train, validation = load_from_disk(str(out / "data" / "train")), load_from_disk(str(out / "data" / "validation"))
    assert (result.train_rows, result.validation_rows) == (len(train), len(validation))
    for split, ds in (("train", train), ("validation", validation)):
        info = summary["datasets"][split]
        assert info["rows"] == len(ds) > 0
        assert info["tokens"] == sum(ds["num_tokens"]) and info["trainable_tokens"] == sum(ds["num_trainable"])

    # Every conversation taken was regenerated once, and the datasets hold exactly the regenerated ones.
    regenerated = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(regenerated) == summary["regenerate"]["conversations"] == 6
    assert sum(s["taken"] for s in summary["sources"].values()) == 6
    assert sum(s["tokenized_conversations"] for s in summary["sources"].values()) == len(train) + len(validation)
    assert set(train["conversation_id"]) | set(validation["conversation_id"]) == {r["id"] for r in regenerated}
    assert all(r["regenerated_by"] == "smollm2-135m-instruct" for r in regenerated)

    vocab = load_draft_vocab(out / "draft_vocab.safetensors",
                             expect_key=DraftVocabKey(split_fingerprint(train), tokenizer_fingerprint(smollm2.tokenizer)))
    assert vocab.size == 512 and vocab.target_vocab_size == smollm2.vocab_size
    assert summary["draft_vocab"]["coverage"] == pytest.approx(vocab.coverage, abs=1e-6)
    assert vocab.trainable_tokens == summary["datasets"]["train"]["trainable_tokens"]

    # The validation conversations' first turns are the held-out prompts checkpoints are chosen on.
    held_out = [json.loads(line) for line in (out / "data" / "validation_prompts.jsonl").read_text().splitlines()]
    first_turns = {r["id"]: next(m["content"] for m in r["messages"] if m["role"] == "user") for r in regenerated}
    assert {q["question_id"] for q in held_out} == set(validation["conversation_id"])
    assert all(q["turns"] == [first_turns[q["question_id"]]] for q in held_out)

    # A rerun reuses the regenerated answers and the tokenised cache: same datasets, nothing generated.
    again = prepare(recipe, target=smollm2, progress=False, show_summary=False)
    assert again.summary["regenerate"]["regenerated_now"] == 0
    assert again.summary["regenerate"]["reused_from_previous_run"] == 6
    assert again.summary["datasets"] == summary["datasets"] | {
        s: dict(summary["datasets"][s], cache_hit=True) for s in ("train", "validation")}
    assert load_from_disk(str(out / "data" / "train"))["input_ids"] == train["input_ids"]


def test_a_source_can_keep_its_own_answers_while_others_are_regenerated(tmp_path, repo_data, smollm2):
    from drafttrain.data.conversations import load_conversations

    raw = tiny_recipe(tmp_path, repo_data)
    raw["data"]["sources"][1]["regenerate"] = False  # gpteacher_roleplay keeps its written answers
    result = prepare(parse_recipe(raw), target=smollm2, progress=False, show_summary=False)
    sources = result.summary["sources"]
    assert sources["gpteacher_roleplay"]["regenerated"] is None and sources["gpteacher_roleplay"]["taken"] == 2
    assert sources["gsm8k_train"]["regenerated"] == sources["gsm8k_train"]["taken"] == 4
    regenerated = [json.loads(line) for line in (tmp_path / "run" / "regenerated.jsonl").read_text().splitlines()]
    assert {r["source"] for r in regenerated} == {"gsm8k_train"}

    # The kept conversations reach the datasets with the source's own answer text.
    from datasets import concatenate_datasets, load_from_disk

    rows = concatenate_datasets([load_from_disk(str(tmp_path / "run" / "data" / s)) for s in ("train", "validation")])
    kept_ids = [cid for cid in rows["conversation_id"] if cid.startswith("gpteacher_roleplay:")]
    assert len(kept_ids) == 2
    written = {c["id"]: c for c in load_conversations(
        str(repo_data / "data" / "train" / "gpteacher_roleplay.json"), "auto", name="gpteacher_roleplay").conversations}
    for cid in kept_ids:
        answer = written[cid]["messages"][-1]["content"]
        row = rows[rows["conversation_id"].index(cid)]
        trained = smollm2.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert answer.strip()[:40] in trained


def test_asking_a_source_to_regenerate_when_regeneration_is_off_is_refused(tmp_path, repo_data):
    raw = tiny_recipe(tmp_path, repo_data, regenerate={"enabled": False})
    raw["data"]["sources"][0]["regenerate"] = True
    with pytest.raises(DrafttrainError, match="regenerate.enabled is false"):
        parse_recipe(raw)


def test_checkpoints_are_chosen_on_held_out_prompts_that_the_report_does_not_use(tmp_path):
    from drafttrain.evaluation.checkpoint_eval import selection_prompts
    from drafttrain.evaluation.suites import load_suite

    mt_bench = load_suite("mt_bench").questions
    recipe = parse_recipe({"output_dir": str(tmp_path), "eval": {"suite": "mt_bench", "num_prompts": 8}})
    assert selection_prompts(recipe) is None  # no validation split: nothing held out to choose on
    prompts = [{"question_id": "v1", "category": "alpaca", "turns": ["Name three colours."]},
               {"question_id": "v2", "category": "alpaca", "turns": [mt_bench[0].turns[0]]},  # also in the report
               {"question_id": "v3", "category": "gsm8k", "turns": ["What is 12 * 7?"]}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "validation_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    chosen = selection_prompts(recipe)
    assert [q.question_id for q in chosen.questions] == ["v1", "v3"]
    assert not {q.turns[0] for q in chosen.questions} & {q.turns[0] for q in mt_bench}
