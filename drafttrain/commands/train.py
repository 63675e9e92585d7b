"""``drafttrain train RECIPE.yaml [key.sub=value ...] [--resume] [--max-steps N]``

Also runs under ``accelerate launch -m drafttrain train RECIPE.yaml`` (every process runs this; the trainer
coordinates them). The recipe is validated in full before the target, data or draft load.
"""

from __future__ import annotations

import argparse
import logging

from drafttrain import DrafttrainError
from drafttrain.config import Recipe, load_recipe
from drafttrain.runfolder import RunFolder, damaged, file_sha256, open_dataset, read_json

log = logging.getLogger(__name__)


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
    from pathlib import Path

    if recipe.draft is None:
        raise DrafttrainError("the recipe has no draft section: set draft.kind (e.g. eagle3)")
    if recipe.training.deepspeed is not None and not Path(recipe.training.deepspeed).is_file():
        raise DrafttrainError(f"training.deepspeed: file not found: {recipe.training.deepspeed}")
    if recipe.data is not None and recipe.data.packing:
        raise DrafttrainError(
            "data.packing: drafts are trained on unpacked rows (their attention is not document-aware yet); "
            "set data.packing: false"
        )
    from drafttrain.training.runtime import configured_zero_stage

    if configured_zero_stage(recipe.training) == 3:
        from drafttrain.training.trainer import check_zero3

        check_zero3(recipe.draft.kind, recipe.draft.trains_target)
        if recipe.eval.every_checkpoint:
            raise DrafttrainError(
                "eval.every_checkpoint decodes with the whole target in one process, which ZeRO-3 partitions over "
                "all of them: set eval.every_checkpoint: false and measure checkpoints with `drafttrain eval` on a "
                "machine that holds the target")
    if recipe.eval.every_checkpoint:
        from drafttrain.evaluation.checkpoint_eval import eval_tree

        eval_tree(recipe)
    run = RunFolder.of(recipe.output_dir)
    if not run.train_split.is_dir():
        raise DrafttrainError(
            f"no prepared training data at {run.train_split}: run `drafttrain prepare` with this recipe first"
        )


def run(args: argparse.Namespace) -> int:
    train(recipe_from_args(args), resume=args.resume)
    return 0


def train(recipe: Recipe, resume: bool = False, target=None):
    """Load the target (unless given), the prepared data and a fresh draft of the recipe's kind; train; return the
    TrainResult."""
    check_trainable(recipe)
    from accelerate.utils import set_seed

    from drafttrain.drafts import build_drafter
    from drafttrain.targets import load_target
    from drafttrain.training.plan import check_fits
    from drafttrain.training.runtime import build_accelerator, configured_zero_stage, gathered
    from drafttrain.training.trainer import Trainer, online_outputs

    run = RunFolder.of(recipe.output_dir)
    check_fits(recipe, "train")  # before the target loads: refuse a run that clearly cannot fit here
    dataset = open_dataset(run.train_split)
    zero3 = configured_zero_stage(recipe.training) == 3
    # Under ZeRO-3 the accelerator exists before the target loads, so from_pretrained partitions it (zero.Init).
    accelerator = build_accelerator(recipe.training) if zero3 else None
    target = target if target is not None else load_target(recipe.target)
    fingerprint = check_split_is_current(run, dataset, target)
    check_draft_vocab_is_current(recipe, run, fingerprint, target)
    set_seed(recipe.seed)  # the draft's initial weights
    with gathered(start_weights(target), zero3):  # what a draft may start from, whole while it is built
        drafter = build_drafter(recipe.draft, target, run)
    if recipe.training.hidden_states == "offline":
        from drafttrain.training.features import FeatureCache

        outputs = FeatureCache(run.features, target, drafter.needs(), fingerprint).outputs
    else:
        outputs = online_outputs(target, drafter)
    callbacks = checkpoint_callbacks(recipe, target, run)
    best_metric = recipe.training.best_metric or ("tau" if callbacks else None)  # keep the best by real tau
    trainer = Trainer(recipe, target, drafter, dataset, outputs_fn=outputs, callbacks=callbacks, best_metric=best_metric,
                      accelerator=accelerator)
    result = trainer.train(resume=resume)
    if trainer.accelerator.is_main_process:
        best = f"; best: {result.best_checkpoint} ({result.best['metric']}={result.best['value']:.4g})" \
            if result.best else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"trained {result.steps} steps, final loss {loss}; checkpoint: {result.last_checkpoint}{best}")
    return result


def start_weights(target) -> list:
    """The target weights drafts start from (init_from_target): its embeddings, lm_head, final norm and last
    layer. Under ZeRO-3 only these are gathered while the draft is built, never the whole target."""
    from drafttrain.targets.hidden import decoder_layers, final_norm

    model = target.model
    parts = [model.get_input_embeddings(), model.get_output_embeddings(), final_norm(model), decoder_layers(model)[-1]]
    return list(dict.fromkeys(p for part in parts if part is not None for p in part.parameters()))


def check_split_is_current(run: RunFolder, dataset, target) -> str:
    """The train split must be what prepare wrote (its fingerprint in data/manifest.json), tokenised with this
    target's tokenizer, and the validation split and prompts too. Returns the train split's fingerprint, which every
    artifact built from it records."""
    from drafttrain.data.tokenize import split_fingerprint, tokenizer_fingerprint

    manifest = read_json(run.data_manifest)
    fingerprint = split_fingerprint(dataset)
    if fingerprint != manifest.get("train"):
        raise damaged(run.train_split, f"does not hash to the fingerprint prepare recorded in {run.data_manifest} "
                                       "(it was changed after prepare wrote it)")
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != manifest.get("tokenizer"):
        raise DrafttrainError(f"{run.train_split} was tokenised with another tokenizer than the target's "
                              f"({target.name}): rerun `drafttrain prepare` with this recipe")
    check_validation_is_current(run, manifest)
    return fingerprint


def check_validation_is_current(run: RunFolder, manifest: dict) -> None:
    """The held-out split and prompts (which choose the best checkpoint) must be the ones prepare wrote with this
    train split (``manifest``: data/manifest.json): a validation set left from other data could overlap the
    training rows."""
    from drafttrain.data.tokenize import split_fingerprint

    recorded = manifest.get("validation")
    present = run.validation_split.is_dir()
    if present != (recorded is not None) or (present and split_fingerprint(open_dataset(run.validation_split))
                                              != recorded):
        raise damaged(run.validation_split, f"is not the validation split prepare recorded in {run.data_manifest} "
                                            "(changed, added or left from another prepare)")
    if "validation_prompts" in manifest:  # recorded since the run folder's prompts file was fingerprinted
        sha = file_sha256(run.validation_prompts) if run.validation_prompts.is_file() else None
        if sha != manifest["validation_prompts"]:
            raise damaged(run.validation_prompts, f"is not the file prepare recorded in {run.data_manifest}")


def check_draft_vocab_is_current(recipe: Recipe, run: RunFolder, fingerprint: str, target) -> None:
    """The run's draft vocab (written by `drafttrain prepare`) must come from this train split and tokenizer: a
    mapping left from other data would silently mask the wrong tokens."""
    from drafttrain.data.tokenize import tokenizer_fingerprint
    from drafttrain.data.vocab import DraftVocabKey, load_draft_vocab

    if recipe.draft_vocab.enabled:
        load_draft_vocab(run.draft_vocab, expect_key=DraftVocabKey(fingerprint, tokenizer_fingerprint(target.tokenizer)))


def checkpoint_callbacks(recipe: Recipe, target, run: RunFolder) -> list:
    """Callbacks run after each checkpoint (fn(step, checkpoint_dir) -> metrics): held-out simulated tau and a
    real tau / speedup on held-out prompts, so the best checkpoint is kept by measured acceptance."""
    if not recipe.eval.every_checkpoint:
        return []
    from drafttrain.evaluation.checkpoint_eval import CheckpointEvaluator

    validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
    return [CheckpointEvaluator(recipe, target, validation)]
