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
VALIDATION_SPLIT = Path("data") / "validation"


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
    if recipe.data is not None and recipe.data.packing:
        raise DrafttrainError(
            "data.packing: EAGLE heads are trained on unpacked rows (their attention is not document-aware "
            "yet); set data.packing: false, or use length-grouped batches"
        )
    train_dir = Path(recipe.output_dir) / TRAIN_SPLIT
    if not train_dir.is_dir():
        raise DrafttrainError(
            f"no prepared training data at {train_dir}: run `drafttrain prepare` with this recipe first"
        )


def run(args: argparse.Namespace) -> int:
    train(recipe_from_args(args), resume=args.resume)
    return 0


def train(recipe: Recipe, resume: bool = False, target=None):
    """Load the target (unless given), the prepared data and a fresh head; train; return the TrainResult."""
    check_trainable(recipe)
    import datasets
    from accelerate.utils import set_seed

    from drafttrain.drafts import build_draft
    from drafttrain.targets import load_target
    from drafttrain.training.trainer import Trainer

    dataset = datasets.load_from_disk(str(Path(recipe.output_dir) / TRAIN_SPLIT))
    target = target if target is not None else load_target(recipe.target)
    check_draft_vocab_is_current(recipe, dataset, target)
    set_seed(recipe.seed)  # the draft's initial weights
    draft = build_draft(recipe.draft, target, output_dir=recipe.output_dir)
    callbacks = checkpoint_callbacks(recipe, target)
    best_metric = recipe.training.best_metric or ("tau" if callbacks else None)  # keep the best by real tau
    trainer = Trainer(recipe, target, draft, dataset, features_fn=features_fn(recipe, target, draft),
                      callbacks=callbacks, best_metric=best_metric)
    result = trainer.train(resume=resume)
    if trainer.accelerator.is_main_process:
        best = f"; best: {result.best_checkpoint} ({result.best['metric']}={result.best['value']:.4g})" \
            if result.best else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"trained {result.steps} steps, final loss {loss}; checkpoint: {result.last_checkpoint}{best}")
    return result


def check_draft_vocab_is_current(recipe: Recipe, dataset, target) -> None:
    """The run's draft vocab (written by `drafttrain prepare`) must come from this train split and tokenizer: a
    mapping left from other data would silently mask the wrong tokens. A mapping the recipe names is the user's."""
    from drafttrain.data.vocab import draft_vocab_key, load_draft_vocab
    from drafttrain.drafts.eagle3 import DRAFT_VOCAB_FILE

    path = Path(recipe.output_dir) / DRAFT_VOCAB_FILE
    if getattr(recipe.draft, "draft_vocab", None) or not path.is_file():
        return
    load_draft_vocab(path, expect_key=draft_vocab_key(dataset, target.tokenizer, target.vocab_size))


def features_fn(recipe: Recipe, target, draft):
    """Online: the target runs inside each step. Offline: stream the cache `drafttrain prepare` wrote."""
    from drafttrain.training.features import FEATURE_CACHE, FeatureCache, compute_features

    if recipe.training.hidden_states == "online":
        return compute_features
    cache = FeatureCache(Path(recipe.output_dir) / FEATURE_CACHE, target, draft.target_layers)
    return lambda target, batch, layers: cache.features(batch["row_index"].tolist(), batch["input_ids"].shape[1])


def checkpoint_callbacks(recipe: Recipe, target) -> list:
    """Callbacks run after each checkpoint (fn(step, checkpoint_dir) -> metrics): held-out simulated tau and a
    real tau / speedup from the evaluator, so the best checkpoint is kept by measured acceptance."""
    if not recipe.eval.every_checkpoint:
        return []
    import datasets

    from drafttrain.training.checkpoint_eval import CheckpointEvaluator

    validation_dir = Path(recipe.output_dir) / VALIDATION_SPLIT
    validation = datasets.load_from_disk(str(validation_dir)) if validation_dir.is_dir() else None
    return [CheckpointEvaluator(recipe, target, validation)]
