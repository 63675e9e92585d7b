"""``drafttrain train RECIPE.yaml [key.sub=value ...] [--resume] [--max-steps N] [--gate]``

Also runs under ``accelerate launch -m drafttrain train RECIPE.yaml`` (every process runs this; the trainer
coordinates them). The recipe is validated in full before the target, data or draft load (drafttrain.runs.train).
"""

from __future__ import annotations

import argparse

from drafttrain.config import Recipe, load_recipe
from drafttrain.runs.train import train
from drafttrain.training.runtime import end_processes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides (YAML values)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in output_dir (same data order)")
    parser.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps (training.max_steps)")
    parser.add_argument("--gate", action="store_true",
                        help="first the consistency gate (eval.gate): overfit the draft on one row, serve its export "
                             "in vLLM, and stop unless the engine accepts what the head predicts")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    if args.gate:
        overrides.append("eval.gate=true")
    return load_recipe(args.recipe, overrides)


def run(args: argparse.Namespace) -> int:
    try:
        train(recipe_from_args(args), resume=args.resume)
    finally:
        end_processes()
    return 0
