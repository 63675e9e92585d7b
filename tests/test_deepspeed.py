"""DeepSpeed ZeRO-2 on CPU: two processes under ``accelerate launch`` (gloo), resume under ZeRO, and one process
without a launcher. Each run is a real subprocess training the stand-in draft on the tiny target."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import StandInDraft, tiny_target

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "trainer_helpers.py"
ZERO2 = "recipes/deepspeed/zero2_cpu.json"
LAUNCH_CONFIG = "recipes/accelerate/cpu_2proc_zero2.yaml"
TWO_NODES = "recipes/accelerate/cpu_2node_zero2.yaml"
STEPS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a test process must not leak a distributed setup into the launched one
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def rank_reports(output_dir: Path) -> list[dict]:
    return [json.loads((output_dir / f"rank-{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> Path:
    """8 steps on 2 processes (checkpoints at 4 and 8); then, in the same processes, a copy rewound to step 4
    is resumed by a new Trainer (one launch for both keeps the test fast)."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG,
          "--main_process_port", str(_free_port()), str(HELPER), str(out),
          "--max-steps", str(STEPS), "--save-every", "4", "--deepspeed", ZERO2, "--rewind-to", "4"])
    return out


def test_two_process_zero2_trains_and_saves_a_loadable_checkpoint(two_process_run):
    reports = rank_reports(two_process_run)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["distributed_type"].endswith("DEEPSPEED") and report["steps"] == STEPS
    losses = [reports[0]["losses"][str(s)] for s in range(1, STEPS + 1)]
    assert reports[1]["losses"] == reports[0]["losses"]  # the logged loss is the mean over ranks
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses

    ckpt = two_process_run / "checkpoints" / "step-000008"
    assert (two_process_run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    shards = {p.name for p in (ckpt / "accelerate" / "pytorch_model").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= shards
    draft = StandInDraft.from_pretrained(ckpt, tiny_target())
    assert all(torch.isfinite(p).all() for p in draft.parameters())
    assert len((two_process_run / "metrics.jsonl").read_text().splitlines()) == STEPS  # rank 0 only writes


def test_two_process_zero2_resume_matches_the_uninterrupted_run(two_process_run):
    resumed_run = two_process_run.with_name("run-resumed")
    straight = rank_reports(two_process_run)[0]["losses"]
    for report in rank_reports(resumed_run):
        assert report["resumed_from"].endswith("step-000004") and report["steps"] == STEPS
        assert sorted(report["losses"], key=int) == ["5", "6", "7", "8"]
        for step, loss in report["losses"].items():
            assert loss == pytest.approx(straight[step], rel=0, abs=1e-5)


def test_two_nodes_train_and_resume(tmp_path, two_process_run):
    """Two `accelerate launch` processes as two machines (--num_machines 2, --machine_rank 0/1, rank 0's address
    127.0.0.1), one process each: the same losses as two processes on one machine, and resume."""
    port, out = _free_port(), tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", TWO_NODES, "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), str(HELPER), str(out),
         "--max-steps", str(STEPS), "--save-every", "4", "--deepspeed", ZERO2, "--rewind-to", "4"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    one_machine = rank_reports(two_process_run)[0]["losses"]
    for rank, report in enumerate(rank_reports(out)):
        assert report["rank"] == rank and report["world_size"] == 2 and report["steps"] == STEPS
        assert report["losses"] == pytest.approx(one_machine, abs=1e-5)
    for report in rank_reports(out.with_name("run-resumed")):
        assert report["resumed_from"].endswith("step-000004")
        assert report["losses"] == pytest.approx({k: one_machine[k] for k in ("5", "6", "7", "8")}, abs=1e-5)


def test_one_process_zero2_runs_without_a_launcher(tmp_path):
    _run([sys.executable, str(HELPER), str(tmp_path), "--max-steps", "2", "--deepspeed", ZERO2])
    report = json.loads((tmp_path / "rank-0.json").read_text())
    assert report["world_size"] == 1 and report["distributed_type"].endswith("DEEPSPEED") and report["steps"] == 2
    assert (tmp_path / "checkpoints" / "step-000002" / "accelerate" / "pytorch_model").is_dir()


def test_deepspeed_auto_values_come_from_the_recipe_and_conflicts_are_refused():
    from drafttrain import DrafttrainError
    from drafttrain.config import TrainingConfig
    from drafttrain.training.runtime import fill_deepspeed_config, read_deepspeed_config

    training = TrainingConfig(batch_size=3, gradient_accumulation=2, max_grad_norm=0.5)
    config = read_deepspeed_config(str(REPO / ZERO2))
    fill_deepspeed_config(config, training, world_size=2)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["gradient_clipping"], config["train_batch_size"]) == (3, 2, 0.5, 12)
    with pytest.raises(DrafttrainError, match="gradient_accumulation_steps=4 but the recipe implies 2"):
        fill_deepspeed_config({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, training, 1)
    with pytest.raises(DrafttrainError, match="ZeRO-3 is not supported"):
        fill_deepspeed_config({"zero_optimization": {"stage": 3}}, training, 1)
    with pytest.raises(DrafttrainError, match="has an 'optimizer' section"):
        fill_deepspeed_config({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, training, 1)
