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
from trainer_helpers import StandInDraft, fresh_accelerate, one_step_on_unequal_rows, tiny_target  # noqa: F401

# integration: several processes, or the real target trained end to end (CI runs them; `-m "not slow"` skips)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "trainer_helpers.py"
ZERO2 = "recipes/deepspeed/zero2_cpu.json"
ZERO3 = "recipes/deepspeed/zero3_cpu.json"
LAUNCH_CONFIG = "recipes/accelerate/cpu_2proc_zero2.yaml"
TWO_NODES = "recipes/accelerate/cpu_2node_zero2.yaml"
STEPS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a test process must not leak a distributed setup into the launched one
    return env


# Limits against a hang, not timings: the first launch on a clean machine also compiles DeepSpeed's shared-memory
# communication op, which on 2 busy cores took past 120 s.
def _run(command: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
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
          "--max-steps", str(STEPS), "--save-every", "4", "--deepspeed", ZERO2, "--rewind-to", "4",
          "--reduction-probe"])
    return out


def test_token_reduction_counts_the_trained_tokens_of_every_process(two_process_run, tmp_path, fresh_accelerate):
    """Two processes, one row each (2 and 14 trained tokens): under loss_reduction "token" the step's gradient is
    one process's on both rows at once (its norm before clipping, as DeepSpeed reports it); under "micro_batch"
    each process's mean counts alike, and it is not."""
    probes = [json.loads((two_process_run / f"rank-{r}-reduction.json").read_text()) for r in (0, 1)]
    assert probes[0] == probes[1]  # the norm of the one gradient every rank holds
    one_process = one_step_on_unequal_rows(tmp_path, batch_size=2).grad_norm
    assert probes[0]["token"] == pytest.approx(one_process, rel=1e-5)
    assert probes[0]["micro_batch"] != pytest.approx(one_process, rel=1e-2)


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


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    """As two_process_run, under ZeRO-3: the target partitioned in a frozen engine, the draft partitioned too."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG,
          "--main_process_port", str(_free_port()), str(HELPER), str(out),
          "--max-steps", str(STEPS), "--save-every", "4", "--deepspeed", ZERO3, "--rewind-to", "4"])
    return out


def test_zero3_partitions_the_target_and_computes_what_one_process_computes(zero3_run, two_process_run):
    from safetensors.torch import load_file
    from trainer_helpers import PROBE_IDS

    from drafttrain.targets import TargetNeeds, run_target

    with torch.no_grad():  # the whole target, in this one process
        whole = run_target(tiny_target(), {"input_ids": PROBE_IDS}, TargetNeeds(layers=(1, 2), logits=True))
    reports = rank_reports(zero3_run)
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2 and report["steps"] == STEPS
        assert report["target_share"] <= 0.55  # each rank holds about half of the target's weights
        probe = load_file(str(zero3_run / f"rank-{rank}-probe.safetensors"))
        torch.testing.assert_close(probe["hidden"], whole.hidden, rtol=0, atol=1e-6)
        torch.testing.assert_close(probe["logits"], whole.logits, rtol=0, atol=1e-6)
    assert rank_reports(two_process_run)[0]["target_share"] == 1.0  # ZeRO-2 keeps it whole on every rank
    # the same losses as ZeRO-2, which holds everything whole (same processes, same rows)
    assert reports[0]["losses"] == pytest.approx(rank_reports(two_process_run)[0]["losses"], abs=1e-5)


def test_zero3_checkpoints_hold_the_whole_draft_and_resume(zero3_run, two_process_run):
    from safetensors.torch import load_file

    ckpt, reference = (run / "checkpoints" / "step-000008" for run in (zero3_run, two_process_run))
    saved, expected = load_file(str(ckpt / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], rtol=0, atol=1e-5)
    draft = StandInDraft.from_pretrained(ckpt, tiny_target())  # one process, no DeepSpeed
    assert all(torch.isfinite(p).all() for p in draft.parameters())
    straight = rank_reports(zero3_run)[0]["losses"]
    for report in rank_reports(zero3_run.with_name("run-resumed")):
        assert report["resumed_from"].endswith("step-000004")
        assert report["losses"] == pytest.approx({k: straight[k] for k in ("5", "6", "7", "8")}, abs=1e-5)


@pytest.mark.parametrize("draft", [
    pytest.param({"kind": "eagle3", "ttt_steps": 2, "init_from_target": ["lm_head", "layer", "fc"]}, id="eagle3"),
    pytest.param({"kind": "dflash", "block_size": 4, "anchors": 8, "num_layers": 2, "init_from_target": True},
                 id="dflash")])
def test_zero3_train_command_partitions_the_target_at_load_and_saves_what_zero2_saves(tmp_path, folder_target, draft):
    """`accelerate launch -m drafttrain train` under ZeRO-3: the target (a saved folder) loads partitioned, the
    draft starts from its gathered weights (lm_head, last layers, norm), and the run's losses and checkpoint equal
    those of the same run under ZeRO-2; the checkpoint loads in one process."""
    zero3_against_zero2(tmp_path, folder_target, draft)


def test_zero3_partitions_an_moe_target_and_computes_what_zero2_computes(tmp_path, moe_folder_target):
    """The same for a Qwen3-MoE target: every expert partitioned over the two processes, gathered layer by layer
    for the forward; the head starts from the target's lm_head and fc (an MoE layer is no Llama-style layer)."""
    zero3_against_zero2(tmp_path, moe_folder_target, {"kind": "eagle3", "ttt_steps": 2,
                                                      "init_from_target": ["lm_head", "fc"]})


def test_zero3_fine_tunes_a_targets_own_mtp_layer_as_zero2_does(tmp_path):
    """The mtp kind under ZeRO-3 on a GLM-4.5-layout MoE target that ships an MTP layer: the layer starts from the
    checkpoint's own weights, drafts through the target's embeddings and lm_head (partitioned over the processes,
    gathered where the layer calls them), and trains as under ZeRO-2."""
    from families import family_model, save_with_native_mtp

    from drafttrain.targets import load_tokenizer

    folder = tmp_path / "glm4_moe"
    save_with_native_mtp(family_model("glm4_moe"), folder, load_tokenizer("smollm2-135m-instruct"))
    zero3_against_zero2(tmp_path, folder, {"kind": "mtp", "steps": 2})


def zero3_against_zero2(tmp_path, target_folder, draft) -> None:
    from conftest import small_recipe
    from safetensors.torch import load_file

    from drafttrain.commands import main
    from drafttrain.drafts import load_drafter
    from drafttrain.targets import load_target

    runs = {}
    for name, launch, config in (("zero3", "recipes/accelerate/cpu_2proc_zero3.yaml", ZERO3),
                                 ("zero2", LAUNCH_CONFIG, ZERO2)):
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, draft, target={"model": str(target_folder)},
                              eval={"every_checkpoint": False},
                              training={"batch_size": 2, "max_steps": 4, "save_every": 4, "log_every": 1,
                                        "deepspeed": str(REPO / config)})
        assert main(["prepare", str(recipe), "--no-progress"]) == 0  # one process: here
        done = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch,
                     "--main_process_port", str(_free_port()), "-m", "drafttrain", "train", str(recipe)], timeout=600)
        runs[name] = tmp_path / name / "run"
        if name == "zero3":
            assert "frozen (ZeRO-3: partitioned over the processes)" in done.stdout and "2 process(es)" in done.stdout
            assert done.stderr.count("loaded partitioned over the processes (ZeRO-3)") == 2  # at load, each rank
    records = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for name, run in runs.items()}
    losses = {name: [r["loss"] for r in rows if "loss" in r] for name, rows in records.items()}
    assert losses["zero3"] == pytest.approx(losses["zero2"], abs=1e-5) and len(losses["zero3"]) == 4
    # the held-out accuracy, measured in the sharded forward over both processes' rows, is one process's figure
    from test_held_out import checked_against_one_process
    held = checked_against_one_process(runs["zero3"], str(target_folder))
    assert [r["step"] for r in held] == [4]
    saved, expected = (load_file(str(run / "checkpoints" / "step-000004" / "model.safetensors"))
                       for run in (runs["zero3"], runs["zero2"]))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
    for key in expected:
        torch.testing.assert_close(saved[key], expected[key], rtol=0, atol=1e-5)
    assert load_drafter(runs["zero3"], load_target(str(target_folder))).kind == draft["kind"]


def test_launched_prepare_splits_the_offline_cache_over_the_processes(tmp_path, folder_target):
    """`accelerate launch -m drafttrain prepare` with 2 processes: each writes its own shards, the main process
    joins them, and the cache holds exactly what one process writes."""
    from conftest import small_recipe
    from safetensors.torch import load_file

    caches = {}
    for name, launched in (("two", True), ("one", False)):
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, {"kind": "eagle3"}, target={"model": str(folder_target)},
                              training={"hidden_states": "offline", "cache_shard_rows": 2})
        command = ["-m", "drafttrain", "prepare", str(recipe), "--no-progress"]
        done = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG,
                     "--main_process_port", str(_free_port()), *command] if launched else [sys.executable, *command])
        caches[name] = tmp_path / name / "run" / "features"
        if launched:
            assert "rank 0 wrote 3 shards" in done.stderr and "rank 1 wrote 2 shards" in done.stderr
    index = {name: json.loads((cache / "index.json").read_text()) for name, cache in caches.items()}
    assert [s["rows"] for s in index["two"]["shards"]] == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert {k: v for k, v in index["two"].items() if k != "shards"} == {k: v for k, v in index["one"].items()
                                                                         if k != "shards"}
    for ours, theirs in zip(index["two"]["shards"], index["one"]["shards"]):
        a, b = load_file(str(caches["two"] / ours["file"])), load_file(str(caches["one"] / theirs["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_nodes_train_and_resume(tmp_path, two_process_run):
    """Two `accelerate launch` processes as two machines (--num_machines 2, --machine_rank 0/1, rank 0's address
    127.0.0.1), one process each: the same losses as two processes on one machine, and resume."""
    port, out = _free_port(), tmp_path / "run"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", TWO_NODES, "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), str(HELPER), str(out),
         "--max-steps", str(STEPS), "--save-every", "4", "--deepspeed", ZERO2, "--rewind-to", "4"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
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
    zero3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    fill_deepspeed_config(zero3, training, 1)  # the draft is gathered whole for every checkpoint
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero3["bf16"]["enabled"] is False  # "auto" resolved from the recipe (fp32 here)
    with pytest.raises(DrafttrainError, match="has an 'optimizer' section"):
        fill_deepspeed_config({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, training, 1)


def test_zero3_refuses_what_it_cannot_do_before_anything_loads(tmp_path):
    from conftest import small_recipe

    from drafttrain import DrafttrainError
    from drafttrain.config import load_recipe
    from drafttrain.runs.train import check_trainable

    medusa2 = {"kind": "medusa", "target_lora": {"target_modules": ["q_proj"]}}
    zero3 = {"deepspeed": str(REPO / ZERO3)}
    recipe = load_recipe(small_recipe(tmp_path, medusa2, training=zero3, eval={"every_checkpoint": False}))
    with pytest.raises(DrafttrainError, match="trains its target .* cannot run under ZeRO-3"):
        check_trainable(recipe)
    recipe = load_recipe(small_recipe(tmp_path, {"kind": "eagle3"}, training=zero3))
    with pytest.raises(DrafttrainError, match="eval.every_checkpoint .* ZeRO-3 partitions"):
        check_trainable(recipe)
