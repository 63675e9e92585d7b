"""Nothing silently wrong: a real (tiny) SmolLM2 run folder, damaged one artifact at a time — truncated, bytes
flipped, NaN written, a field edited, an earlier stage rerun with other data. Each case ends in an error that names
the file and the way out, or in the right recovery, and no earlier good artifact is lost."""

from __future__ import annotations

import copy
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from drafttrain import DrafttrainError
from drafttrain.commands import main

pytestmark = pytest.mark.slow

STEP = "checkpoints/step-{:06d}"


def write_recipe(folder: Path, **training) -> Path:
    recipe = {
        "output_dir": str(folder / "run"),
        "target": {"model": "smollm2-135m-instruct"},
        "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 12}],
                 "num_samples": 12, "validation_fraction": 0.25, "max_length": 96},
        "regenerate": {"enabled": False},
        "draft_vocab": {"enabled": True, "size": 256},
        "draft": {"kind": "eagle3", "ttt_steps": 2, "layers": [2, 15], "intermediate_size": 64},
        "training": {"max_steps": 3, "save_every": 1, "keep_last": 3, "learning_rate": 1e-3,
                     "scheduler": "constant", "log_every": 1, **training},
        "eval": {"every_checkpoint": False},
        "wandb": {"mode": "disabled"},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    recipe = write_recipe(folder)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    return folder


@pytest.fixture
def run(good_run, tmp_path):
    """A copy of the good run to damage, with its recipe pointing at the copy."""
    shutil.copytree(good_run / "run", tmp_path / "run")
    write_recipe(tmp_path)
    return tmp_path


def drafttrain(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def flip_bytes(path: Path, at: int = -64) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def write_nan_tensors(path: Path) -> None:
    """Overwrite every float32 tensor's data bytes with NaN, keeping the safetensors header intact."""
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] == "F32":
            start, end = (8 + header_len + o for o in info["data_offsets"])
            data[start:end] = struct.pack("<f", float("nan")) * ((end - start) // 4)
    path.write_bytes(bytes(data))


def export_copy(checkpoint: Path, to: Path) -> Path:
    """The draft files alone, as a user copies them out of a run (no manifest)."""
    to.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(checkpoint / name, to / name)
    return to


def eval_args(draft: Path, out: Path) -> list:
    return ["eval", "--target", "smollm2-135m-instruct", "--draft", draft, "--num-prompts", "1", "--turns", "1",
            "--max-new-tokens", "4", "--no-progress", "--out", out]


# --------------------------------------------------------------------------------------------- the four silent ones


def test_a_stale_offline_feature_cache_is_refused(run, capsys):
    recipe = run / "recipe.yaml"
    assert drafttrain(capsys, "prepare", recipe, "training.hidden_states=offline", "--no-progress")[0] == 0
    # prepare again with other data, online: the features of the first split stay on disk
    assert drafttrain(capsys, "prepare", recipe, "seed=7", "--no-progress")[0] == 0
    shutil.rmtree(run / "run" / "checkpoints")
    code, out = drafttrain(capsys, "train", recipe, "seed=7", "training.hidden_states=offline")
    assert code == 2 and "built from other training rows" in out and "stale" in out
    assert (run / "run" / "features" / "index.json").is_file()  # refused, not deleted


def test_an_infinite_learning_rate_is_refused_before_any_work(run, capsys):
    shutil.rmtree(run / "run" / "checkpoints")
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "training.learning_rate=.inf")
    assert code == 2 and "training.learning_rate: Input should be a finite number" in out
    assert not (run / "run" / "checkpoints").exists()


def test_a_diverged_run_names_a_last_good_checkpoint_that_is_good(run, capsys):
    """With a learning rate of 1e30 the loss goes non-finite at step N; the checkpoint of step N-1 holds finite but
    exploded weights (they produced it) and used to be named "the last good checkpoint", and evaluated without a
    word. It is set aside now, and the one before it is named."""
    shutil.rmtree(run / "run" / "checkpoints")
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "training.learning_rate=1e30", "--max-steps", "6")
    assert code == 2 and "training stopped" in out, out
    failed = int(re.search(r"non-finite (?:loss|gradient norm) \(.*?\) at step (\d+)", out).group(1))
    root = run / "run" / "checkpoints"
    assert (root / f"step-{failed - 1:06d}.diverged").is_dir()
    good = f"the last good checkpoint is {root / f'step-{failed - 2:06d}'}" if failed > 2 else \
        "no checkpoint was saved yet"
    assert good in out, out


def test_nan_bytes_in_a_saved_draft_are_refused(run, capsys):
    checkpoint = run / "run" / STEP.format(3)
    exported = export_copy(checkpoint, run / "exported")
    write_nan_tensors(checkpoint / "model.safetensors")
    code, out = drafttrain(capsys, *eval_args(checkpoint, run / "eval"))
    assert code == 2 and "model.safetensors does not match its checksum in manifest.json" in out
    write_nan_tensors(exported / "model.safetensors")  # no manifest: the weights themselves are checked
    code, out = drafttrain(capsys, *eval_args(exported, run / "eval2"))
    assert code == 2 and "holds non-finite weights" in out


def test_a_changed_learning_rate_is_applied_on_resume(run, capsys):
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "training.max_steps=4",
                           "training.learning_rate=5e-4")  # overrides after a flag are accepted
    assert code == 0, out
    assert "applying the recipe's new training.learning_rate 0.001 -> 0.0005" in out
    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert lrs[3] == pytest.approx(1e-3) and lrs[4] == pytest.approx(5e-4)


# --------------------------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("name", ["accelerate/optimizer.bin", "accelerate/scheduler.bin", "accelerate/model.safetensors",
                                  "accelerate/random_states_0.pkl", "trainer_state.json", "model.safetensors"])
def test_resume_skips_a_damaged_checkpoint_and_says_which(run, capsys, name):
    flip_bytes(run / "run" / STEP.format(3) / name, at=len((run / "run" / STEP.format(3) / name).read_bytes()) // 2)
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 0, out
    assert f"skipped step-000003: {run / 'run' / STEP.format(3) / name} does not match its checksum" in out
    assert "resumed from" in out and "step-000002" in out
    assert (run / "run" / STEP.format(2)).is_dir() and (run / "run" / STEP.format(4)).is_dir()


def test_resume_refuses_when_no_checkpoint_verifies_and_deletes_nothing(run, capsys):
    for step in (1, 2, 3):
        truncate(run / "run" / STEP.format(step) / "accelerate" / "optimizer.bin")
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "no checkpoint under" in out and "verifies" in out and "step-000001" in out
    assert all((run / "run" / STEP.format(step)).is_dir() for step in (1, 2, 3))


def test_a_resume_past_damaged_checkpoints_never_prunes_a_good_one_for_them(run, capsys):
    """Resume falls back from damaged steps 3 and 2 to step 1 and trains to step 2: pruning (keep_last 1) must keep
    the step it just wrote and the best, not the damaged step 3; the last line names the step written, and `eval
    --draft RUN` takes the best."""
    for step in (2, 3):
        flip_bytes(run / "run" / STEP.format(step) / "model.safetensors")
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "2",
                           "training.keep_last=1")
    assert code == 0, out
    assert f"checkpoint: {run / 'run' / STEP.format(2)}" in out
    # the best by the held-out prediction (never pruned) is a good step too, never a damaged one
    best = json.loads((run / "run" / "checkpoints" / "best.json").read_text())["checkpoint"]
    assert best in ("step-000001", "step-000002")
    assert sorted(p.name for p in (run / "run" / "checkpoints").glob("step-*")) == sorted(
        {"step-000002", best, "step-000002.damaged", "step-000003.damaged"})  # damaged: kept for inspection only
    code, out = drafttrain(capsys, *eval_args(run / "run", run / "eval"))
    assert code == 0, out
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["config"]["draft"]["path"] == str(run / "run" / "checkpoints" / best)


def test_a_damaged_train_split_names_the_stage_that_wrote_it(run, capsys):
    arrow = next((run / "run" / "data" / "train").glob("*.arrow"))
    truncate(arrow)
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "data/train" in out and "drafttrain prepare" in out and "Traceback" not in out


def test_a_damaged_draft_vocab_names_the_stage_that_wrote_it(run, capsys):
    flip_bytes(run / "run" / "draft_vocab.safetensors", at=20)
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "draft_vocab.safetensors" in out and "drafttrain prepare" in out


def test_a_damaged_tokenised_cache_is_rebuilt(run, capsys):
    from datasets import load_from_disk

    before = load_from_disk(str(run / "run" / "data" / "train"))["input_ids"]
    for arrow in (run / "run" / "cache" / "tokenized").glob("*/*.arrow"):
        truncate(arrow)
    code, out = drafttrain(capsys, "prepare", run / "recipe.yaml", "--no-progress")
    assert code == 0, out
    assert load_from_disk(str(run / "run" / "data" / "train"))["input_ids"] == before


def test_a_damaged_feature_index_names_the_stage_that_wrote_it(run, capsys):
    recipe = run / "recipe.yaml"
    assert drafttrain(capsys, "prepare", recipe, "training.hidden_states=offline", "--no-progress")[0] == 0
    (run / "run" / "features" / "index.json").write_text('{"shards": [')
    code, out = drafttrain(capsys, "train", recipe, "training.hidden_states=offline", "--resume", "--max-steps", "4")
    assert code == 2 and "features/index.json is not valid JSON" in out and "drafttrain prepare" in out


def test_edited_or_damaged_draft_configs_are_named(run, capsys):
    checkpoint = run / "run" / STEP.format(3)
    config = json.loads((checkpoint / "config.json").read_text())
    cases = {
        "not valid JSON": "{",
        "names draft kind 'eagle9'": json.dumps(copy.deepcopy(config) | {"drafttrain": config["drafttrain"] | {"kind": "eagle9"}}),
        "does not fit the eagle3 draft": json.dumps(config | {"draft_vocab_size": 300}),
    }
    for i, (message, text) in enumerate(cases.items()):
        exported = export_copy(checkpoint, run / f"exported{i}")
        (exported / "config.json").write_text(text)
        code, out = drafttrain(capsys, *eval_args(exported, run / f"eval{i}"))
        assert code == 2 and message in out, out
    (checkpoint / "config.json").write_text(json.dumps(config | {"draft_vocab_size": 300}))
    code, out = drafttrain(capsys, *eval_args(checkpoint, run / "eval"))
    assert code == 2 and "config.json does not match its checksum" in out


def test_errors_name_the_command_that_wrote_the_file_and_report_skips_a_half_written_last_line(run, capsys):
    """A damaged config of a draft copied out of its run was said to be "written by `drafttrain prepare`: rerun
    prepare"; a half-written last line of metrics.jsonl (a crash mid-append) made `drafttrain report` refuse."""
    exported = export_copy(run / "run" / STEP.format(3), run / "copied")
    (exported / "config.json").write_text("{")
    code, out = drafttrain(capsys, *eval_args(exported, run / "eval"))
    assert code == 2 and "written by `drafttrain train` or `drafttrain export`" in out and "prepare" not in out, out
    with (run / "run" / "metrics.jsonl").open("a") as log:
        log.write('{"step": 9, "loss": 1.')
    code, out = drafttrain(capsys, "report", run / "run")
    assert code == 0, out
    (run / "run" / "metrics.jsonl").write_text('{"step": 1\n' + (run / "run" / "metrics.jsonl").read_text())
    code, out = drafttrain(capsys, "report", run / "run")
    assert code == 2 and "line 1 is not JSON" in out and "written by `drafttrain train`" in out, out


def test_a_draft_for_another_tokenizer_is_refused_at_the_same_vocab_size(run, smollm2):
    from drafttrain.drafts import load_drafter
    from drafttrain.targets import Target

    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tokenizer.add_tokens(["<|another_token|>"], special_tokens=True)  # the model's vocabulary stays 49,152
    other = Target("smollm2-other-tokenizer", smollm2.model, tokenizer)
    assert other.vocab_size == smollm2.vocab_size
    with pytest.raises(DrafttrainError, match="trained for a target with another tokenizer"):
        load_drafter(run / "run", other)
    assert load_drafter(run / "run", smollm2).kind == "eagle3"


def test_train_split_rows_changed_after_prepare_are_refused(run, capsys):
    from datasets import load_from_disk

    split = run / "run" / "data" / "train"
    rows = load_from_disk(str(split)).to_dict()
    rows["input_ids"][0] = rows["input_ids"][0][::-1]  # same length, other tokens
    shutil.rmtree(split)
    type(load_from_disk(str(run / "run" / "data" / "validation"))).from_dict(rows).save_to_disk(str(split))
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "does not hash to the fingerprint prepare recorded" in out


def test_resume_refuses_another_draft_or_other_data_by_name(run, capsys):
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4", "draft.ttt_steps=3")
    assert code == 2 and "draft.ttt_steps was 2, now 3" in out
    assert drafttrain(capsys, "prepare", run / "recipe.yaml", "seed=7", "--no-progress")[0] == 0
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "seed=7", "--resume", "--max-steps", "4")
    assert code == 2 and "it was trained with another data" in out
    assert (run / "run" / STEP.format(3)).is_dir()


def test_a_damaged_best_pointer_is_ignored_and_the_checkpoints_still_found(run):
    from drafttrain.runfolder import find_draft

    (run / "run" / "checkpoints" / "best.json").write_text("{oops")
    assert find_draft(run / "run") == run / "run" / STEP.format(3)


def test_a_split_tokenised_with_another_tokenizer_is_refused(run, smollm2):
    from drafttrain.runfolder import RunFolder, open_dataset
    from drafttrain.runs.train import check_split_is_current
    from drafttrain.targets import Target

    folder = RunFolder.of(run / "run")
    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tokenizer.add_tokens(["<|another_token|>"], special_tokens=True)
    check_split_is_current(folder, open_dataset(folder.train_split), smollm2)  # the tokenizer it was made with
    with pytest.raises(DrafttrainError, match="tokenised with another tokenizer"):
        check_split_is_current(folder, open_dataset(folder.train_split), Target("other", smollm2.model, tokenizer))


def test_a_validation_split_or_prompts_file_changed_after_prepare_is_refused(run, capsys):
    from datasets import load_from_disk

    prompts = run / "run" / "data" / "validation_prompts.jsonl"
    original = prompts.read_text()
    prompts.write_text(original.replace('"', '"x', 1) if original else "{}\n")
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "validation_prompts.jsonl" in out and "is not the file prepare recorded" in out
    prompts.write_text(original)
    split = run / "run" / "data" / "validation"
    loaded = load_from_disk(str(split))
    fewer = type(loaded).from_dict(loaded.select(range(len(loaded) - 1)).to_dict())  # a row fewer, in memory
    shutil.rmtree(split)
    fewer.save_to_disk(str(split))
    code, out = drafttrain(capsys, "train", run / "recipe.yaml", "--resume", "--max-steps", "4")
    assert code == 2 and "is not the validation split prepare recorded" in out
