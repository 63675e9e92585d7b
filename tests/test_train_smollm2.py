"""End to end on the real SmolLM2 target: prepare → train (online and offline features) → per-checkpoint eval."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO
from drafttrain.cli import main


def write_recipe(tmp_path, **training):
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "target": {"model": "smollm2-135m-instruct"},
        "data": {
            "sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 10}],
            "num_samples": 10, "validation_fraction": 0.2, "max_length": 96,
        },
        "regenerate": {"enabled": False},  # the dataset answers are enough to see the loss fall
        "draft_vocab": {"enabled": True, "size": 2048},
        "draft": {"kind": "eagle3", "ttt_steps": 3},
        "training": {"epochs": 3, "learning_rate": 2e-3, "save_every": 12, "log_every": 4, **training},
        "eval": {"suite": "mt_bench", "num_prompts": 1, "max_new_tokens": 8, "depth": 3},
        "wandb": {"mode": "disabled"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def read_metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("online")
    recipe = write_recipe(tmp)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    return tmp / "run"


def test_training_lowers_the_loss_on_the_real_target(online_run):
    losses = [r["loss"] for r in read_metrics(online_run) if "loss" in r]
    assert len(losses) >= 4
    assert losses[-1] < 0.8 * losses[0], losses


def test_every_checkpoint_is_evaluated_and_the_best_is_kept_by_real_tau(online_run):
    ckpts = sorted((online_run / "checkpoints").glob("step-*"))
    assert ckpts
    for ckpt in ckpts:
        metrics = json.loads((ckpt / "eval.json").read_text())
        metrics = metrics.get("metrics", metrics)
        assert metrics["greedy_match"] == 1.0
        assert 1.0 <= metrics["tau"] <= 4.0 and metrics["sim_tau"] >= 1.0
        assert (ckpt / "eval" / "report.json").is_file()
    best = json.loads((online_run / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "tau"
    evals = [r for r in read_metrics(online_run) if "eval/tau" in r]
    assert max(r["eval/tau"] for r in evals) == pytest.approx(best["value"])


def test_offline_features_train_like_online(online_run, tmp_path):
    recipe = write_recipe(tmp_path, hidden_states="offline", max_steps=4)
    assert main(["prepare", str(recipe), "eval.every_checkpoint=false", "--no-progress"]) == 0
    assert (tmp_path / "run" / "features" / "index.json").is_file()
    assert main(["train", str(recipe), "eval.every_checkpoint=false"]) == 0
    offline = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    online = [r["loss"] for r in read_metrics(online_run) if "loss" in r]
    # same data order, same initial weights: only the bf16 storage of the cached features differs
    assert offline[0] == pytest.approx(online[0], rel=0.05)


def test_training_refuses_a_recipe_without_prepared_data(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert main(["train", str(recipe)]) == 2
    assert "run `drafttrain prepare`" in capsys.readouterr().err
