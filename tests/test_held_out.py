"""Held-out accuracy at every checkpoint (training/held_out.py): measured in the run's own forward on the validation
rows, from the run's own kind of source, logged as ``eval/val_acc_k``, ``eval/sim_tau`` and ``eval/val_loss``; the
same figures as a one-process ``held_out()`` on the saved checkpoint, whether the target's outputs come from the HF
forward or the offline cache. Two ZeRO-3 processes are checked in tests/test_deepspeed.py."""

from __future__ import annotations

import json

import pytest
from conftest import small_recipe

from drafttrain.commands import main
from drafttrain.drafts import load_drafter
from drafttrain.evaluation.checkpoint_eval import held_out
from drafttrain.runfolder import RunFolder, open_dataset
from drafttrain.targets import load_target
from drafttrain.training.held_out import HELD_OUT_ROWS, rows_of


@pytest.mark.parametrize("rows, world", [(3, 1), (3, 2), (7, 4), (1, 3), (HELD_OUT_ROWS + 5, 2)])
def test_every_held_out_row_is_counted_once_and_every_process_runs_as_many_rows(rows, world):
    shares = [rows_of(rows, rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # ZeRO-3: a process missing a forward would hang the others
    counted = sorted(row for share in shares for row, counts in share if counts)
    assert counted == list(range(min(rows, HELD_OUT_ROWS)))


def held_out_records(run) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval/val_acc_0" in r]


def checked_against_one_process(run, target_model) -> list[dict]:
    """The run's held-out records, each checked against ``held_out()`` in this process on its saved checkpoint."""
    records = held_out_records(run)
    target = load_target(target_model)
    validation = open_dataset(RunFolder(run).validation_split)
    for record in records:
        checkpoint = run / "checkpoints" / f"step-{record['step']:06d}"
        accuracies, _ = held_out(load_drafter(checkpoint, target), target, validation)
        assert [record[f"eval/val_acc_{i}"] for i in range(len(accuracies))] == pytest.approx(accuracies, abs=1e-6)
    return records


@pytest.mark.parametrize("hidden_states", ["online", "offline"])
def test_every_checkpoint_logs_its_held_out_accuracy_and_the_best_is_kept_by_it(tmp_path, folder_target,
                                                                                hidden_states):
    recipe = small_recipe(tmp_path, {"kind": "eagle3", "ttt_steps": 2}, target={"model": str(folder_target)},
                          eval={"every_checkpoint": False},
                          training={"hidden_states": hidden_states, "max_steps": 4, "save_every": 2,
                                    "learning_rate": 3e-3})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert (run / "features" / "validation").is_dir() == (hidden_states == "offline")
    assert main(["train", str(recipe)]) == 0
    records = checked_against_one_process(run, str(folder_target))
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert {"eval/val_acc_1", "eval/sim_tau", "eval/val_loss"} <= record.keys()
        assert 1.0 <= record["eval/sim_tau"] <= 3.0 and record["eval/val_loss"] > 0
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "sim_tau"
    assert best["value"] == pytest.approx(max(r["eval/sim_tau"] for r in records))
