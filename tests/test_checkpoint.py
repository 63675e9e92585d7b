"""Checkpoints: layout, reload, keep-last pruning that spares the best, and crash safety of the atomic save."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import StandInDraft, fresh_accelerate, make_trainer, reset_accelerate, tiny_target  # noqa: F401

from drafttrain import DrafttrainError
from drafttrain.runfolder import write_manifest
from drafttrain.training.checkpoint import CheckpointManager, TrainerState

pytestmark = pytest.mark.usefixtures("fresh_accelerate")




def test_checkpoint_layout_and_reload(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=4, save_every=2, keep_last=1)
    result = trainer.train()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000004"]  # step-000002 pruned
    assert (root / "latest").read_text().strip() == "step-000004" and result.last_checkpoint == root / "step-000004"
    ckpt = root / "step-000004"
    state = TrainerState.read(ckpt / "trainer_state.json")
    assert (state.step, state.epoch, state.batch_in_epoch, state.data_seed, state.world_size) == (4, 0, 4, 0, 1)
    assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl", "model.safetensors"} <= {
        p.name for p in (ckpt / "accelerate").iterdir()}
    # The draft export holds the draft only: no target weights.
    saved = load_file(str(ckpt / "model.safetensors"))
    assert set(saved) == set(trainer.drafter.state_dict())
    reloaded = StandInDraft.from_pretrained(ckpt, tiny_target())
    for name, tensor in trainer.drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor.cpu()), name


def test_best_checkpoint_survives_pruning(tmp_path):
    tau_by_step = {2: 1.0, 4: 3.0, 6: 2.0, 8: 1.5}
    trainer = make_trainer(tmp_path, max_steps=8, save_every=2, keep_last=1, best_metric="tau",
                           callbacks=[lambda step, ckpt: {"tau": tau_by_step[step]}])
    result = trainer.train()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000004", "step-000008"]
    assert result.best_checkpoint == root / "step-000004" and result.best["value"] == 3.0
    assert json.loads((root / "step-000008" / "eval.json").read_text()) == {"tau": 1.5}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/tau"]) for r in records if "eval/tau" in r] == sorted(tau_by_step.items())


def test_crash_mid_save_keeps_the_previous_checkpoint_and_resume_cleans_up(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=6, save_every=2)
    real_save = trainer.drafter.save_pretrained

    def save_then_die(directory):
        if "step-000004" in str(directory):
            (directory / "model.safetensors").write_bytes(b"half a file")
            raise OSError("simulated crash while saving")
        return real_save(directory)

    monkeypatch.setattr(trainer.drafter, "save_pretrained", save_then_die)
    with pytest.raises(OSError, match="simulated crash"):
        trainer.train()
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000002"
    assert (root / "step-000004.tmp").is_dir() and not (root / "step-000004").exists()
    assert CheckpointManager(root, keep_last=2).latest() == root / "step-000002"
    StandInDraft.from_pretrained(root / "step-000002", tiny_target())  # loads

    reset_accelerate()
    resumed = make_trainer(tmp_path, max_steps=6, save_every=2).train(resume=True)
    assert resumed.resumed_from == root / "step-000002" and sorted(resumed.losses) == [3, 4, 5, 6]
    assert not any(p.name.endswith(".tmp") for p in root.iterdir())
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000004", "step-000006"]


def test_manager_commits_only_complete_folders_and_repairs_a_stale_pointer(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    tmp = manager.begin(1)
    (tmp / "model.safetensors").write_bytes(b"x")
    with pytest.raises(DrafttrainError, match="incomplete"):
        manager.commit(1)  # no trainer_state.json yet
    (tmp / "trainer_state.json").write_text("{}")
    with pytest.raises(DrafttrainError, match="incomplete.*manifest.json missing"):
        manager.commit(1)  # no checksums yet
    write_manifest(tmp, {"data": "d"})
    assert manager.commit(1) == tmp_path / "step-000001"
    (tmp_path / "latest").write_text("step-000000\n")  # e.g. a crash between the rename and the pointer update
    (tmp_path / "step-000002.old").mkdir()  # an interrupted prune
    manager.remove_orphans()
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    assert not (tmp_path / "step-000002.old").exists()


def test_resume_refuses_a_different_data_layout(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_every=2).train()
    reset_accelerate()
    with pytest.raises(DrafttrainError, match="cannot resume.*global batch was 4×1 processes, now 2×1"):
        make_trainer(tmp_path, max_steps=4, batch_size=2).train(resume=True)


def test_a_tie_for_best_goes_to_the_newer_checkpoint(tmp_path):
    """Checkpoints that `--depth auto` serves as plain decoding all measure tau 1.0: the last trained is kept."""
    tau_by_step = {2: 1.0, 4: 1.0, 6: 0.9}
    trainer = make_trainer(tmp_path, max_steps=6, save_every=2, keep_last=1, best_metric="tau",
                           callbacks=[lambda step, ckpt: {"tau": tau_by_step[step]}])
    assert trainer.train().best_checkpoint == tmp_path / "checkpoints" / "step-000004"


@pytest.mark.parametrize("sim_tau_by_step, best", [
    ({2: 1.30, 4: 1.45, 6: 1.40}, 4),  # the DFlash run's case: step 500 held out better than the last, 523
    ({2: 1.50, 4: 1.45, 6: 1.40}, 2),
    ({2: 1.30, 4: 1.40, 6: 1.40}, 6),  # a tie on both: the newer
])
def test_a_tie_for_best_goes_to_the_higher_held_out_tau(tmp_path, sim_tau_by_step, best):
    trainer = make_trainer(tmp_path, max_steps=6, save_every=2, keep_last=1, best_metric="tau",
                           callbacks=[lambda step, ckpt: {"tau": 1.0, "sim_tau": sim_tau_by_step[step]}])
    assert trainer.train().best_checkpoint == tmp_path / "checkpoints" / f"step-00000{best}"
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text())["sim_tau"] == sim_tau_by_step[best]


def test_a_higher_best_metric_wins_over_a_higher_held_out_tau(tmp_path):
    tau, sim_tau = {2: 1.2, 4: 1.1}, {2: 1.3, 4: 1.6}
    trainer = make_trainer(tmp_path, max_steps=4, save_every=2, keep_last=1, best_metric="tau",
                           callbacks=[lambda step, ckpt: {"tau": tau[step], "sim_tau": sim_tau[step]}])
    assert trainer.train().best_checkpoint == tmp_path / "checkpoints" / "step-000002"


def test_a_run_folder_resolves_to_its_best_checkpoint_then_its_newest(tmp_path):
    from drafttrain.runfolder import find_draft

    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        (root / f"step-00000{step}").mkdir(parents=True)
        (root / f"step-00000{step}" / "trainer_state.json").write_text("{}")
        (root / f"step-00000{step}" / "config.json").write_text("{}")
    (root / "step-000006.tmp").mkdir()  # an interrupted save is never chosen
    (root / "best.json").write_text(json.dumps({"checkpoint": "step-000002", "step": 2, "metric": "tau", "value": 1.5}))
    assert find_draft(tmp_path / "run") == root / "step-000002"
    assert find_draft(root) == root / "step-000002"
    assert find_draft(root / "step-000004") == root / "step-000004"  # a head folder is taken as it is
    (root / "best.json").unlink()
    assert find_draft(tmp_path / "run") == root / "step-000004"
    with pytest.raises(DrafttrainError, match="no draft checkpoint at"):
        find_draft(tmp_path / "elsewhere")
