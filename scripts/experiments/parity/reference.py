"""Train a draft with a reference trainer on the rows and features of scripts/experiments/parity/features.py, for a given
training time, and import what it wrote as a drafttrain checkpoint for our evaluator.

    python scripts/experiments/parity/reference.py speculators FEATURES OUT --venv .venvs/speculators --minutes 15 \
        [--kind dflash|eagle3|peagle] [--seed 0] [--calibrate-steps 12] -- [extra speculators train flags]

speculators has no time budget, only ``--max-steps``: a short calibration run measures its seconds per optimizer
step (its own ``profile.step_ms``), and the real run gets the steps that fill ``--minutes`` of training compute,
with the cosine schedule spread over exactly those steps. The settings that must match drafttrain's recipe for a
like-for-like run (draft size, block, draft vocabulary, tokens and anchors per step, optimizer, learning rate,
schedule, dtype) are in ``SPECULATORS_FLAGS``; everything else is speculators' documented default, listed in the
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

from drafttrain.export.importer import import_draft
from drafttrain.targets.loading import load_target, resolve_model_dir

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from features import row_digest  # noqa: E402  (a sibling script, not a package)

# Both recipes (recipes/smollm2_dflash.yaml, scripts/experiments/parity/eagle3.yaml) train with AdamW at this rate, cosine decay
# after these warm-up steps; every trainer is given them
LEARNING_RATE = 8e-4
WARMUP_STEPS = {"dflash": 20, "eagle3": 30, "peagle": 30}
# drafttrain's recipes in speculators' flags, per kind (with the schedule above, in speculators_command). The tokens
# per optimizer step (--total-seq-len, speculators packs rows up to it) are drafttrain's 4 rows (2 rows x 2
# accumulation) at the run's mean row length: tokens_per_step
SPECULATORS_FLAGS = {
    # 2 layers, block 8, the run's 8192-token draft vocabulary, 64 anchors a row (256 a pack of 4 rows)
    "dflash": ["--speculator-type", "dflash", "--num-layers", "2", "--block-size", "8", "--draft-vocab-size", "8192",
               "--max-anchors", "256", "--optimizer", "adamw"],
    # 1 layer, TTT 3, vanilla EAGLE-3 (no EAGLE-3.1 norms, speculators' defaults; the residual un-normed, as vLLM's
    # EAGLE-3 reads drafttrain's exports), the run's 8192-token draft vocabulary, AdamW without weight decay
    "eagle3": ["--speculator-type", "eagle3", "--num-layers", "1", "--ttt-steps", "3", "--draft-vocab-size", "8192",
               "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual", "--optimizer", "adamw",
               "--weight-decay", "0"],
    # P-EAGLE (drafttrain: the EAGLE-3 kind with parallel.depths 8, on eagle3.yaml's rows): 1 layer of Llama's kind
    # (its default is a Qwen3 layer, q and k normed) with full attention (its default is a 2048-token window, which
    # drafttrain's P-EAGLE head does not have, so its import refuses it), 8 depths, COD 0.7 / 0.2 (both sides'
    # defaults), vanilla norms and AdamW as for eagle3, the run's 8192-token draft vocabulary; its embedding table
    # frozen (cpu_shim.py)
    "peagle": ["--speculator-type", "peagle", "--num-layers", "1", "--draft-arch", "llama",
               "--full-attention-indices", "0", "--num-depths", "8", "--down-sample-ratio", "0.7",
               "--down-sample-ratio-min", "0.2", "--draft-vocab-size", "8192", "--no-norm-before-fc",
               "--no-norm-output", "--no-norm-before-residual", "--optimizer", "adamw", "--weight-decay", "0"],
}
# on a CPU: fp32, no flex attention backward, no Triton, no dataloader workers
SPECULATORS_CPU = ["--hidden-states-dtype", "float32", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
                   "--num-workers", "0", "--on-missing", "raise", "--log-freq", "1"]
ROWS_PER_STEP = 4


def tokens_per_step(record: dict) -> int:
    """drafttrain's tokens per optimizer step (4 rows of the run's mean length), at least the longest row."""
    lengths = record["train_lengths"]
    return max(max(lengths), round(ROWS_PER_STEP * sum(lengths) / len(lengths)))


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


def speculators_command(args, save: Path, steps: int, epochs: int) -> list[str]:
    record = json.loads((args.features / "rows.json").read_text())
    return [str(Path(args.venv) / "bin" / "python"), str(HERE / "cpu_shim.py"), "train", "--verifier-name-or-path",
            resolve_model_dir("smollm2-135m-instruct"), "--data-path", str(args.features / "speculators"),
            "--d2t-path", str(args.features / "vocab" / "d2t.npy"),
            "--t2d-path", str(args.features / "vocab" / "t2d.npy"),
            "--train-data-ratio", str(record["train_data_ratio"]), *SPECULATORS_FLAGS[args.kind], *SPECULATORS_CPU,
            "--lr", str(LEARNING_RATE), "--scheduler-type", "cosine",
            "--scheduler-warmup-steps", str(WARMUP_STEPS[args.kind]),
            "--total-seq-len", str(tokens_per_step(record)), "--seed", str(args.seed),
            "--max-steps", str(steps), "--scheduler-total-steps", str(steps), "--epochs", str(epochs),
            "--save-path", str(save), "--no-resume-from-checkpoint", *args.extra]


def specforge_target(out: Path) -> Path:
    """The target folder as SpecForge's TargetHead reads it: the model's files and an index naming the weight file."""
    model_dir = Path(resolve_model_dir("smollm2-135m-instruct"))
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if not (target / item.name).exists():
            (target / item.name).symlink_to(item)
    weights = {name: "model.safetensors" for name in safe_open(str(model_dir / "model.safetensors"), "pt").keys()}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    return target


TARGET_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act",
                 "bos_token_id", "eos_token_id")


def specforge_draft_config(kind: str, features: Path) -> dict:
    """A 2-layer DFlashDraftModel with block 8, or a 1-layer LlamaForCausalLMEagle3 over the run's 8192-token draft
    vocabulary, on the same taps (SpecForge numbers layers by their output: its [1, 14, 26] are our inputs of
    [2, 15, 27])."""
    config = json.loads((Path(resolve_model_dir("smollm2-135m-instruct")) / "config.json").read_text())
    layers = [layer - 1 for layer in json.loads((features / "rows.json").read_text())["layers"]]
    base = {**{k: config[k] for k in TARGET_FIELDS}, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False}
    if kind == "eagle3":
        return {**base, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "draft_vocab_size": 8192, "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}}
    return {**base, "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 2,
            "num_target_layers": config["num_hidden_layers"], "block_size": 8,
            "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False,
            # the mask token SpecForge resolves for SmolLM2 by itself (id 2), written so that its export names it
            "dflash_config": {"target_layer_ids": layers, "mask_token_id": 2}}


def specforge_files(args, out: Path, steps: int) -> Path:
    """SpecForge's inputs for an offline run like drafttrain's recipe: its target folder, the draft config and the run
    config: AdamW at 8e-4 with cosine decay after the recipe's warm-up steps, fp32, sdpa, one process, the recipe's 4
    rows per optimizer step. EAGLE-3: TTT 3 (SpecForge's default is 7), the run's draft vocabulary map. Everything else
    is SpecForge's default: DFlash over the whole vocabulary (its DFlash has no draft vocabulary), uniform position
    weights (loss_type dflash), grad clip 0.5, random init; EAGLE-3 with step weights 0.8**i, grad clip 0.5."""
    target = specforge_target(out)
    (out / "draft_config.json").write_text(json.dumps(specforge_draft_config(args.kind, args.features), indent=1))
    model = {"target_model_path": str(target), "draft_model_config": str(out / "draft_config.json"),
             "embedding_key": "model.embed_tokens.weight", "lm_head_key": "model.embed_tokens.weight",
             "torch_dtype": "float32"}  # the taps come from the draft config's layer ids
    training = {"strategy": args.kind, "max_steps": steps, "total_steps": steps, "num_epochs": 4,
                "batch_size": args.batch_size, "learning_rate": LEARNING_RATE,
                "warmup_ratio": min(0.5, WARMUP_STEPS[args.kind] / steps),
                "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "log_interval": 1, "save_interval": steps,
                "seed": args.seed}
    if args.kind == "eagle3":
        model["vocab_mapping_path"] = str(args.features / "vocab" / "vocab_mapping.pt")
        training.update(ttt_length=3, accumulation_steps=ROWS_PER_STEP // args.batch_size)
    else:
        training.update(num_anchors=64)
    run = {"model": model,
           "data": {"hidden_states_path": str(args.features / "specforge" / args.kind), "max_length": 768,
                    "dataloader_num_workers": 0},
           "training": training,
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


def seconds_per_step(args) -> float:
    log = args.out / "calibration.log"
    run_logged(speculators_command(args, args.out / "calibration", args.calibrate_steps, 1), log)
    return warm_mean([s["step_ms"] / 1000 for s in logged_steps(log)])


def train_speculators(args) -> dict:
    rows_sha = check_rows(args.features, str(Path(args.venv) / "bin" / "python"))
    per_step = seconds_per_step(args)
    steps = max(1, int(args.minutes * 60 / per_step))
    record = json.loads((args.features / "rows.json").read_text())
    # enough epochs for the steps (packs of --total-seq-len tokens, a tenth lost to packing): --max-steps ends it
    epochs = math.ceil(steps / (0.9 * sum(record["train_lengths"]) / tokens_per_step(record)))
    command = speculators_command(args, args.out / "checkpoints", steps, epochs)
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
    config = specforge_files(args, out, steps)
    env_command = ["env", "TORCH_COMPILE_DISABLE=1", f"PYTHONPATH={HERE / 'specforge_shim'}",
                   str(Path(args.venv) / "bin" / "specforge"), "train",
                   "--config", str(config)]
    wall = run_logged(env_command, out / "train.log")
    return wall, specforge_steps(out / "train.log")


def specforge_checkpoint(out: Path) -> Path:
    found = sorted(out.glob("checkpoints/**/training_state.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"SpecForge wrote no checkpoint under {out / 'checkpoints'}")
    return found[-1].parent


def specforge_to_speculators(args, out: Path) -> Path:
    """SpecForge's own export (z-lab's DFlashDraftModel layout, or EAGLE's LlamaForCausalLMEagle3 with the vocabulary
    map), then speculators' own converter."""
    forge = Path(args.venv) / "bin" / "specforge"
    vocab = ["--vocab-mapping", str(args.features / "vocab" / "vocab_mapping.pt")] if args.kind == "eagle3" else []
    run_logged([str(forge), "export", "--to", "hf", "--checkpoint", str(specforge_checkpoint(out)),
                "--draft-config", str(out / "draft_config.json"), "--output-dir", str(out / "hf"),
                "--embedding-source", str(out / "target"), *vocab], out / "export.log")
    converter = Path(args.speculators_venv) / "bin" / "speculators"
    run_logged([str(converter), "convert", str(out / "hf"), "--algorithm", args.kind, "--verifier",
                resolve_model_dir("smollm2-135m-instruct"), "--output-path", str(out / "speculators")],
               out / "convert.log")
    return out / "speculators"


def check_forge_rows(features: Path, kind: str) -> str:
    """SpecForge's files must hold the run's train rows (and none of its validation rows)."""
    record = json.loads((features / "rows.json").read_text())
    folder = features / "specforge" / kind
    files = sorted(folder.glob("data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    digests = []
    for path in files:
        row = torch.load(path, weights_only=True)
        digests.append(row_digest(row["input_ids"].tolist(), row["loss_mask"].tolist()))
    if digests != record["row_sha256"][:record["train_rows"]]:
        raise SystemExit(f"the rows in {folder} differ from the run's train rows: rebuild FEATURES")
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def train_specforge(args) -> dict:
    rows_sha = check_forge_rows(args.features, args.kind)
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
    parser.add_argument("--kind", choices=sorted(SPECULATORS_FLAGS), default="dflash")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("features", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--calibrate-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4,
                        help="SpecForge: rows per batch (EAGLE-3: accumulated to 4 rows per optimizer step)")
    parser.add_argument("--speculators-venv", default=".venvs/speculators",
                        help="SpecForge: the venv whose `speculators convert` turns its export into speculators' format")
    parser.add_argument("extra", nargs="*", help="more flags for the trainer (after --)")
    args = parser.parse_args(argv)
    if args.trainer == "specforge" and args.kind == "peagle":
        parser.error("SpecForge 0.2.0 trains P-EAGLE only from its SGLang capture server (no offline features)")
    if args.kind == "peagle":  # cpu_shim.py: P-EAGLE's embedding table frozen, as drafttrain's head reads the target's
        os.environ["PEAGLE_FROZEN_EMBEDDINGS"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    record = train_speculators(args) if args.trainer == "speculators" else train_specforge(args)
    imported, notes = import_draft(record["checkpoint"], load_target("smollm2-135m-instruct"), args.out / "imported",
                                   overwrite=True)
    record.update(kind=args.kind, seed=args.seed, imported=str(imported), import_notes=notes)
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "command"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
