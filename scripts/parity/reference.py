"""Train a draft with a reference trainer on the rows and features of scripts/parity/features.py, for a given
training time, and import what it wrote as a drafttrain checkpoint for our evaluator.

    python scripts/parity/reference.py speculators FEATURES OUT --venv /work/venvs/speculators --minutes 15 \
        [--calibrate-steps 12] -- [extra speculators train flags]

speculators has no time budget, only ``--max-steps``: a short calibration run measures its seconds per optimizer
step (its own ``profile.step_ms``), and the real run gets the steps that fill ``--minutes`` of training compute,
with the cosine schedule spread over exactly those steps. The settings that must match drafttrain's recipe for a
like-for-like run (draft size, block, draft vocabulary, tokens and anchors per step, optimizer, learning rate,
schedule, dtype) are in ``SPECULATORS_DFLASH``; everything else is speculators' documented default, listed in the
run record. Written to OUT: train.log, run.json (the command, the steps, training seconds from its own log, the
rows' sha256 checked against FEATURES/rows.json), checkpoints/ (speculators' own) and imported/ (drafttrain's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from drafttrain.targets.loading import load_target, resolve_model_dir
from drafttrain.export.importer import import_draft

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from features import row_digest  # noqa: E402  (a sibling script, not a package)

# drafttrain's recipes/smollm2_dflash.yaml in speculators' flags: 2 layers, block 8, the run's 8192-token draft
# vocabulary, the tokens and anchors of 4 rows per optimizer step (ours: 2 rows x 2 accumulation, 64 anchors a
# row; the rows average 216 tokens, so packs of 864), AdamW at 8e-4 with cosine decay after 20 warm-up steps, fp32
SPECULATORS_DFLASH = ["--speculator-type", "dflash", "--num-layers", "2", "--block-size", "8",
                      "--draft-vocab-size", "8192", "--total-seq-len", "864", "--max-anchors", "256",
                      "--optimizer", "adamw", "--lr", "8e-4", "--scheduler-type", "cosine",
                      "--scheduler-warmup-steps", "20", "--hidden-states-dtype", "float32",
                      # CPU: no flex attention backward, no Triton, no dataloader workers
                      "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
                      "--on-missing", "raise", "--log-freq", "1"]


def check_rows(features: Path, python: str) -> str:
    """The rows speculators will read (its arrow dataset, through its own Python) must be the run's, in order."""
    script = ("import json,sys; from datasets import load_from_disk; d=load_from_disk(sys.argv[1]); "
              "print(json.dumps([[list(map(int,r['input_ids'])), list(map(int,r['loss_mask']))] for r in d]))")
    rows = json.loads(subprocess.run([python, "-c", script, str(features / "speculators")], check=True,
                                     capture_output=True, text=True).stdout)
    record = json.loads((features / "rows.json").read_text())
    if [row_digest(ids, mask) for ids, mask in rows] != record["row_sha256"]:
        raise SystemExit("the rows speculators reads differ from the run's: rebuild FEATURES")
    return record["all_rows_sha256"]


def speculators_command(python: str, features: Path, save: Path, steps: int, epochs: int, extra: list[str]) -> list[str]:
    record = json.loads((features / "rows.json").read_text())
    return [python, str(HERE / "cpu_shim.py"), "train", "--verifier-name-or-path",
            resolve_model_dir("smollm2-135m-instruct"), "--data-path", str(features / "speculators"),
            "--d2t-path", str(features / "vocab" / "d2t.npy"), "--t2d-path", str(features / "vocab" / "t2d.npy"),
            "--train-data-ratio", str(record["train_data_ratio"]), *SPECULATORS_DFLASH,
            "--max-steps", str(steps), "--scheduler-total-steps", str(steps), "--epochs", str(epochs),
            "--save-path", str(save), "--no-resume-from-checkpoint", *extra]


def specforge_files(features: Path, out: Path, steps: int, batch_size: int) -> Path:
    """SpecForge's inputs for an offline DFlash run like drafttrain's recipe: the target folder as its TargetHead
    reads it (an index naming the weight file), a 2-layer DFlashDraftModel config with block 8 over the same taps
    (SpecForge numbers layers by their output: its [1, 14, 26] are our inputs of [2, 15, 27]), and the run config:
    AdamW at 8e-4 with cosine decay after 20 warm-up steps, fp32, sdpa, one process. Everything else is SpecForge's
    default: the whole vocabulary (its DFlash has no draft vocabulary), uniform position weights (loss_type
    dflash), grad clip 0.5, random init."""
    model_dir = Path(resolve_model_dir("smollm2-135m-instruct"))
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if not (target / item.name).exists():
            (target / item.name).symlink_to(item)
    weights = {name: "model.safetensors" for name in safe_open(str(model_dir / "model.safetensors"), "pt").keys()}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    config = json.loads((model_dir / "config.json").read_text())
    layers = json.loads((features / "rows.json").read_text())["layers"]
    draft = {**{k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                        "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                                        "vocab_size", "hidden_act", "bos_token_id", "eos_token_id")},
             "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 2,
             "num_target_layers": config["num_hidden_layers"], "block_size": 8, "attention_bias": False,
             "attention_dropout": 0.0, "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2,
             "sliding_window": None, "use_sliding_window": False,
             # the mask token SpecForge resolves for SmolLM2 by itself (id 2), written so that its export names it
             "dflash_config": {"target_layer_ids": [layer - 1 for layer in layers], "mask_token_id": 2}}
    (out / "draft_config.json").write_text(json.dumps(draft, indent=1))
    run = {"model": {"target_model_path": str(target), "draft_model_config": str(out / "draft_config.json"),
                     "embedding_key": "model.embed_tokens.weight", "lm_head_key": "model.embed_tokens.weight",
                     "torch_dtype": "float32"},  # the taps come from the draft config's target_layer_ids
           "data": {"hidden_states_path": str(features / "specforge" / "dflash"), "max_length": 768,
                    "dataloader_num_workers": 0},
           "training": {"strategy": "dflash", "max_steps": steps, "total_steps": steps, "num_epochs": 4,
                        "batch_size": batch_size, "learning_rate": 8e-4, "warmup_ratio": min(0.5, 20 / steps),
                        "num_anchors": 64, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                        "log_interval": 1, "save_interval": steps},
           "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
           "output_dir": str(out / "checkpoints")}
    path = out / "specforge.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def run_logged(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        raise SystemExit(f"{command[1]} exited {code}: see {log}")
    return time.perf_counter() - started


def logged_steps(log: Path) -> list[dict[str, float]]:
    """speculators' per-step records from its log (rich ``key=value`` lines): the loss, the step's milliseconds and
    tokens per second, as its own timer measured them."""
    text = log.read_text()
    records = text.split("train/loss=")[1:]
    steps = []
    for record in records:
        def value(key: str, default=math.nan) -> float:
            found = re.search(re.escape(key) + r"=([-+0-9.e]+)", record)
            return float(found.group(1)) if found else default
        steps.append({"loss": float(re.match(r"[-+0-9.e]+", record).group(0)), "step_ms": value("profile/step_ms"),
                      "tokens_per_s": value("profile/tokens_per_s")})
    return steps


def last_checkpoint(save: Path) -> Path:
    epochs = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise SystemExit(f"speculators wrote no checkpoint under {save}")
    return epochs[-1]


def warm_mean(seconds: list[float]) -> float:
    """A calibration run's seconds per step: the mean after its first two steps, which warm up."""
    return sum(seconds[2:]) / len(seconds[2:])


def seconds_per_step(python: str, features: Path, out: Path, steps: int, extra: list[str]) -> float:
    log = out / "calibration.log"
    run_logged(speculators_command(python, features, out / "calibration", steps, 1, extra), log)
    return warm_mean([s["step_ms"] / 1000 for s in logged_steps(log)])


def train_speculators(args) -> dict:
    python = str(Path(args.venv) / "bin" / "python")
    rows_sha = check_rows(args.features, python)
    per_step = seconds_per_step(python, args.features, args.out, args.calibrate_steps, args.extra)
    steps = max(1, int(args.minutes * 60 / per_step))
    record = json.loads((args.features / "rows.json").read_text())
    # enough epochs for the steps (packs of --total-seq-len tokens, a tenth lost to packing): --max-steps ends it
    packs = sum(record["train_lengths"]) / int(SPECULATORS_DFLASH[SPECULATORS_DFLASH.index("--total-seq-len") + 1])
    epochs = math.ceil(steps / (0.9 * packs))
    command = speculators_command(python, args.features, args.out / "checkpoints", steps, epochs, args.extra)
    wall = run_logged(command, args.out / "train.log")
    logged = logged_steps(args.out / "train.log")
    train_s = sum(s["step_ms"] for s in logged) / 1000
    return {"trainer": "speculators 0.9.0", "command": command, "rows_sha256": rows_sha, "calibrated_s_per_step": per_step,
            "steps_planned": steps, "steps_logged": len(logged), "train_seconds": train_s, "wall_seconds": wall,
            "tokens": sum(s["tokens_per_s"] * s["step_ms"] / 1000 for s in logged),
            "first_loss": logged[0]["loss"], "last_loss": logged[-1]["loss"],
            "checkpoint": str(last_checkpoint(args.out / "checkpoints"))}


def specforge_steps(log: Path) -> list[dict[str, float]]:
    """SpecForge's per-step records from its log: the loss and its own compute seconds per step."""
    steps = []
    for line in log.read_text().splitlines():
        compute = re.search(r"perf/train_compute_time_s[\"']?[:=]\s*([-+0-9.e]+)", line)
        if compute:
            loss = re.search(r"'loss':\s*([-+0-9.e]+)", line)
            steps.append({"loss": float(loss.group(1)) if loss else math.nan, "step_s": float(compute.group(1))})
    return steps


def run_specforge(args, out: Path, steps: int) -> tuple[float, list[dict[str, float]]]:
    config = specforge_files(args.features, out, steps, batch_size=args.batch_size)
    env_command = ["env", "TORCH_COMPILE_DISABLE=1", str(Path(args.venv) / "bin" / "specforge"), "train",
                   "--config", str(config)]
    wall = run_logged(env_command, out / "train.log")
    return wall, specforge_steps(out / "train.log")


def specforge_checkpoint(out: Path) -> Path:
    found = sorted(out.glob("checkpoints/**/training_state.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"SpecForge wrote no checkpoint under {out / 'checkpoints'}")
    return found[-1].parent


def specforge_to_speculators(args, out: Path) -> Path:
    """SpecForge's own export (z-lab's DFlashDraftModel layout), then speculators' own converter."""
    forge = Path(args.venv) / "bin" / "specforge"
    run_logged([str(forge), "export", "--to", "hf", "--checkpoint", str(specforge_checkpoint(out)),
                "--draft-config", str(out / "draft_config.json"), "--output-dir", str(out / "hf"),
                "--embedding-source", str(out / "target")], out / "export.log")
    converter = Path(args.speculators_venv) / "bin" / "speculators"
    run_logged([str(converter), "convert", str(out / "hf"), "--algorithm", "dflash", "--verifier",
                resolve_model_dir("smollm2-135m-instruct"), "--output-path", str(out / "speculators")],
               out / "convert.log")
    return out / "speculators"


def check_forge_rows(features: Path) -> str:
    """SpecForge's files must hold the run's train rows (and none of its validation rows)."""
    record = json.loads((features / "rows.json").read_text())
    folder = features / "specforge" / "dflash"
    files = sorted(folder.glob("data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    digests = []
    for path in files:
        row = torch.load(path, weights_only=True)
        digests.append(row_digest(row["input_ids"].tolist(), row["loss_mask"].tolist()))
    if digests != record["row_sha256"][:record["train_rows"]]:
        raise SystemExit(f"the rows in {folder} differ from the run's train rows: rebuild FEATURES")
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def train_specforge(args) -> dict:
    rows_sha = check_forge_rows(args.features)
    _, calibration = run_specforge(args, args.out / "calibration", args.calibrate_steps)
    per_step = warm_mean([s["step_s"] for s in calibration])
    steps = max(1, int(args.minutes * 60 / per_step))
    wall, logged = run_specforge(args, args.out, steps)
    return {"trainer": "SpecForge 0.2.0", "config": str(args.out / "specforge.yaml"), "train_rows_sha256": rows_sha,
            "calibrated_s_per_step": per_step,
            "steps_planned": steps, "steps_logged": len(logged), "train_seconds": sum(s["step_s"] for s in logged),
            "wall_seconds": wall, "first_loss": logged[0]["loss"], "last_loss": logged[-1]["loss"],
            "checkpoint": str(specforge_to_speculators(args, args.out))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trainer", choices=["speculators", "specforge"])
    parser.add_argument("features", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--calibrate-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4, help="SpecForge: rows per optimizer step")
    parser.add_argument("--speculators-venv", default="/work/venvs/speculators",
                        help="SpecForge: the venv whose `speculators convert` turns its export into speculators' format")
    parser.add_argument("extra", nargs="*", help="more flags for the trainer (after --)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = train_speculators(args) if args.trainer == "speculators" else train_specforge(args)
    imported, notes = import_draft(record["checkpoint"], load_target("smollm2-135m-instruct"), args.out / "imported",
                                   overwrite=True)
    record.update(imported=str(imported), import_notes=notes)
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "command"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
