"""``drafttrain train RECIPE.yaml [key.sub=value ...] [--resume] [--max-steps N]``

Also runs under ``accelerate launch -m drafttrain train RECIPE.yaml`` (every process runs this; the trainer
coordinates them). The recipe is validated in full before the target, data or draft load.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from drafttrain import DrafttrainError
from drafttrain.config import Recipe, load_recipe

log = logging.getLogger(__name__)

TRAIN_SPLIT = Path("data") / "train"  # under output_dir, written by `drafttrain prepare`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides (YAML values)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in output_dir (same data order)")
    parser.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps (training.max_steps)")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    recipe = load_recipe(args.recipe, overrides)
    check_trainable(recipe)
    return recipe


def check_trainable(recipe: Recipe) -> None:
    """What `train` needs beyond a valid schema; checked before anything heavy loads."""
    if recipe.draft is None:
        raise DrafttrainError("the recipe has no draft section: set draft.kind (e.g. eagle3)")
    if recipe.training.deepspeed is not None and not Path(recipe.training.deepspeed).is_file():
        raise DrafttrainError(f"training.deepspeed: file not found: {recipe.training.deepspeed}")
    train_dir = Path(recipe.output_dir) / TRAIN_SPLIT
    if not train_dir.is_dir():
        raise DrafttrainError(
            f"no prepared training data at {train_dir}: run `drafttrain prepare` with this recipe first"
        )


def run(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)

    import datasets
    from accelerate.utils import set_seed

    from drafttrain.drafts import build_draft
    from drafttrain.targets import load_target
    from drafttrain.training.trainer import Trainer

    dataset = datasets.load_from_disk(str(Path(recipe.output_dir) / TRAIN_SPLIT))
    target = load_target(recipe.target)
    set_seed(recipe.seed)  # the draft's initial weights
    draft = build_draft(recipe.draft, target, output_dir=recipe.output_dir)
    trainer = Trainer(recipe, target, draft, dataset, features_fn=features_fn(recipe, target, draft),
                      callbacks=checkpoint_callbacks(recipe, target))
    result = trainer.train(resume=args.resume)
    if trainer.accelerator.is_main_process:
        best = f"; best: {result.best_checkpoint} ({result.best['metric']}={result.best['value']:.4g})" \
            if result.best else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"trained {result.steps} steps, final loss {loss}; checkpoint: {result.last_checkpoint}{best}")
    return 0


def features_fn(recipe: Recipe, target, draft):
    """Online: the target runs inside each step. Offline features are the lead's to wire (FeatureCache)."""
    from drafttrain.training.features import compute_features

    if recipe.training.hidden_states == "offline":
        raise DrafttrainError("training.hidden_states: offline is not wired into `drafttrain train` yet")
    return compute_features


def checkpoint_callbacks(recipe: Recipe, target) -> list:
    """Callbacks run after each checkpoint (fn(step, checkpoint_dir) -> metrics); the eval hook goes here."""
    return []
