"""the memory benchmark: peak memory per process on SmolLM2 (CPU), 1 vs 2 processes, no DeepSpeed vs ZeRO-2
vs ZeRO-3, each beside what `drafttrain plan` predicted for it.

    python scripts/experiments/training/bench_memory.py [--steps 6] [--out runs/bench_memory]

The recipe is the quick EAGLE-3 recipe with rows cut to 256 tokens, 2 rows per process and 7 unrolled steps over
the full vocabulary (activations are a real share of the peak). Two processes run under accelerate launch on this
one machine (gloo). Peak memory is what the trainer logs (``peak_memory_mib``: resident memory on CPU, the
fullest process). Results: OUT/memory.json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

RECIPE = "recipes/smollm2_eagle3_quick.yaml"
SETTINGS = ["data.max_length=256", "training.batch_size=2", "draft.ttt_steps=7", "draft_vocab.enabled=false",
            "draft.init_from_target=[]", "eval.every_checkpoint=false", "wandb.mode=disabled", "training.log_every=1",
            "training.save_every=100000"]
CASES = {  # name -> (processes, DeepSpeed config or None)
    "1 process": (1, None),
    "1 process, ZeRO-2": (1, "recipes/deepspeed/zero2_cpu.json"),
    "2 processes, ZeRO-2": (2, "recipes/deepspeed/zero2_cpu.json"),
    "1 process, ZeRO-3": (1, "recipes/deepspeed/zero3_cpu.json"),
    "2 processes, ZeRO-3": (2, "recipes/deepspeed/zero3_cpu.json"),
}


def run(command: list[str], env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench_memory")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled"}
    data = out / "data"
    if not (data / "data").is_dir():  # one prepared run folder, copied for every case
        data.mkdir(exist_ok=True)
        for answers in Path("runs/smollm2_eagle3_quick").glob("regenerated*"):
            shutil.copy(answers, data / answers.name)
        run(["drafttrain", "prepare", RECIPE, f"output_dir={data}", *SETTINGS, "--no-progress"], env)
    results = {}
    for name, (processes, deepspeed) in CASES.items():
        folder = out / name.replace(" ", "_").replace(",", "")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(data, folder)
        overrides = [f"output_dir={folder}", *SETTINGS, f"training.max_steps={args.steps}"]
        if deepspeed:
            overrides.append(f"training.deepspeed={deepspeed}")
        planned = json.loads(run(["drafttrain", "plan", RECIPE, *overrides, "--gpus", str(processes), "--json"],
                                 env).stdout)
        train = ["-m", "drafttrain", "train", RECIPE, *overrides]
        if processes > 1:
            config = "recipes/accelerate/cpu_2proc_zero3.yaml" if "zero3" in deepspeed else \
                "recipes/accelerate/cpu_2proc_zero2.yaml"
            run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port",
                 str(free_port()), *train], env)
        else:
            run([sys.executable, *train], env)
        logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        peak = max(r["peak_memory_mib"] for r in logged if "peak_memory_mib" in r)
        results[name] = {"peak_mib": peak, "planned_mib": planned["total"] / 2**20,
                         "planned_parts_mib": {k: v / 2**20 for k, v in planned["memory"].items()},
                         "final_loss": logged[-1]["loss"]}
        (out / "memory.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {results[name]['peak_mib']:.0f} MiB (plan {results[name]['planned_mib']:.0f})", flush=True)
    print("\n| processes, ZeRO | peak per process (measured) | plan | plan / measured | target weights in plan |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        target = next(v for k, v in r["planned_parts_mib"].items() if k.startswith("target weights"))
        print(f"| {name} | {r['peak_mib']:.0f} MiB | {r['planned_mib']:.0f} MiB | {r['planned_mib'] / r['peak_mib']:.2f} "
              f"| {target:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
