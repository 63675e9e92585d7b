"""Train/serve consistency at full size: train an EAGLE-3 head on nothing but the target's own greedy answers to
the first N MT-Bench prompts, then serve exactly those prompts. A head that knows the answers must be accepted
almost always; if τ stays low, training and serving disagree (taps, token shift, draft vocab, the TTT unroll).
It also shows the speed this machine gives at near-perfect acceptance: a ceiling, not a result.

    python scripts/experiments/training/memorised_head.py [--out /tmp/memo] [--prompts 8] [--new-tokens 96] [--epochs 60]

Writes OUT/prompts.jsonl and OUT/recipe.yaml, then runs `drafttrain prepare`, `train` and `eval` on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from drafttrain.commands import main as drafttrain
from drafttrain.evaluation.suites import load_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/memo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--depth", type=int, default=7)
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = load_suite("mt_bench").select(args.prompts, turns="1")
    (out / "prompts.jsonl").write_text("".join(
        json.dumps({"id": q.question_id, "messages": [{"role": "user", "content": q.turns[0]}]}) + "\n"
        for q in suite.questions))
    recipe = {
        "output_dir": str(out / "run"),
        "seed": 0,
        "target": {"model": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(out / "prompts.jsonl")}], "num_samples": args.prompts,
                 "validation_fraction": 0.0, "max_length": 512},
        "regenerate": {"enabled": True, "max_new_tokens": args.new_tokens, "batch_size": args.prompts},
        "draft_vocab": {"enabled": True, "size": 8192},
        "draft": {"kind": "eagle3", "ttt_steps": args.depth},
        "training": {"epochs": args.epochs, "batch_size": 1, "learning_rate": 1.0e-3, "warmup_steps": 20,
                     "save_every": 1000, "log_every": 40},
        "eval": {"every_checkpoint": False},
        "wandb": {"mode": "disabled"},
    }
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    for command in (["prepare", str(out / "recipe.yaml")], ["train", str(out / "recipe.yaml")]):
        if drafttrain(command) != 0:
            raise SystemExit(f"drafttrain {command[0]} failed")
    checkpoints = out / "run" / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    raise SystemExit(drafttrain([
        "eval", "--target", "smollm2-135m-instruct", "--draft", str(latest),
        "--suite", "mt_bench", "--num-prompts", str(args.prompts), "--turns", "1",
        "--max-new-tokens", str(args.new_tokens), "--depth", str(args.depth), "--out", str(out / "eval"),
    ]))


if __name__ == "__main__":
    main()
