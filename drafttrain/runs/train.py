"""Training a draft from a recipe, as a library call: ``train(recipe)`` loads the target (or the part of it this
process needs), the prepared data and the draft, and trains. The recipe's draft section is resolved once
(drafts/continuation.py: a continued draft's saved files read once) and passed to every check and stage."""

from __future__ import annotations

import logging
from pathlib import Path

from accelerate.utils import set_seed

from drafttrain import DrafttrainError, targets
from drafttrain.config import Recipe
from drafttrain.data.tokenize import describe_run_data, split_fingerprint
from drafttrain.data.vocab import DraftVocabKey, load_draft_vocab
from drafttrain.drafts import start_drafter
from drafttrain.drafts.continuation import ResolvedDraft, check_vocabulary_choice, kept_target_layers, resolve_draft
from drafttrain.evaluation.checkpoint_eval import CheckpointEvaluator, check_eval_shape
from drafttrain.runfolder import DataManifest, RunFolder, RunLock, first_of_launch, open_dataset
from drafttrain.sources.choose import engine_runs_target, process_target, training_source
from drafttrain.targets import Target
from drafttrain.targets.hidden import decoder_layers, final_norm
from drafttrain.training.plan import check_fits
from drafttrain.training.runtime import build_accelerator, configured_zero_stage, gathered
from drafttrain.training.trainer import Trainer, check_zero3

log = logging.getLogger(__name__)


def check_trainable(recipe: Recipe, draft: ResolvedDraft | None = None) -> ResolvedDraft:
    """What `train` needs beyond a valid schema, checked before anything heavy loads; returns the recipe's draft
    section resolved (``draft``, when the caller resolved it already)."""
    if recipe.draft is None:
        raise DrafttrainError("the recipe has no draft section: set draft.kind (e.g. eagle3)")
    # a continued draft (draft.init_from) exists, is of the kind and agrees with the recipe; what follows checks the
    # section it trains with (a saved head count, say), not the recipe's defaults
    draft = draft or resolve_draft(recipe.draft)
    check_vocabulary_choice(draft, recipe.draft_vocab.enabled)
    recipe = recipe.model_copy(update={"draft": draft.section})
    if recipe.training.deepspeed is not None and not Path(recipe.training.deepspeed).is_file():
        raise DrafttrainError(f"training.deepspeed: file not found: {recipe.training.deepspeed}")
    if recipe.data is not None and recipe.data.packing:
        raise DrafttrainError(
            "data.packing: drafts are trained on unpacked rows (their attention is not document-aware yet); "
            "set data.packing: false"
        )

    if configured_zero_stage(recipe.training) == 3:

        check_zero3(recipe.draft.kind, recipe.draft.trains_target)
        if recipe.eval.every_checkpoint:
            raise DrafttrainError(
                "eval.every_checkpoint decodes with the whole target in one process, which ZeRO-3 partitions over "
                "all of them: set eval.every_checkpoint: false and measure checkpoints with `drafttrain eval` on a "
                "machine that holds the target")
    if recipe.eval.every_checkpoint and engine_runs_target(recipe):
        raise DrafttrainError(
            "eval.every_checkpoint decodes with the whole target in this process, and with capture.engine "
            f"{recipe.capture.engine} the trainers hold only its head: set eval.every_checkpoint: false")
    if recipe.eval.every_checkpoint:
        check_eval_shape(recipe)
    run = RunFolder.of(recipe.output_dir)
    if not run.train_split.is_dir():
        raise DrafttrainError(
            f"no prepared training data at {run.train_split}: run `drafttrain prepare` with this recipe first"
        )
    return draft


def train(recipe: Recipe, resume: bool = False, target: Target | None = None):
    """Load the target (unless given), the prepared data and the draft (a fresh one of the recipe's kind, or the
    saved one draft.init_from names); train; return the TrainResult. One process trains in a run folder at a time:
    a launch's rank 0 holds its lock for every rank."""
    draft = check_trainable(recipe)
    run = RunFolder.of(recipe.output_dir)
    if first_of_launch():
        run.claim()  # a folder drafttrain did not make is refused before anything is written or deleted in it
    with RunLock(run.root, "drafttrain train"):
        return _train_in(run, recipe, draft, resume, target)


def _train_in(run: RunFolder, recipe: Recipe, draft: ResolvedDraft, resume: bool, target: Target | None):
    check_fits(recipe, "train", draft)  # before the target loads: refuse a run that clearly cannot fit here
    dataset = open_dataset(run.train_split)
    zero3 = configured_zero_stage(recipe.training) == 3
    # Under ZeRO-3 the accelerator exists before the target loads, so from_pretrained partitions it (zero.Init).
    accelerator = build_accelerator(recipe.training) if zero3 else None
    layers = kept_target_layers(draft)
    target = target if target is not None else run_target_model(recipe, layers)
    fingerprint = check_split_is_current(run, dataset, target)
    check_draft_vocab_is_current(recipe, run, fingerprint, target)
    set_seed(recipe.seed)  # the draft's initial weights
    with gathered(start_weights(target, layers), zero3):  # what a draft may start from, whole while it is built
        drafter = start_drafter(draft, target, run, new_vocabulary=recipe.draft_vocab.enabled)
    callbacks = checkpoint_callbacks(recipe, target, run)
    best_metric = recipe.training.best_metric or ("tau" if callbacks else None)  # keep the best by real tau
    with training_source(recipe, target, drafter.needs(), dataset, fingerprint) as source:
        trainer = Trainer(recipe, target, drafter, dataset, source=source, callbacks=callbacks,
                          best_metric=best_metric, accelerator=accelerator, data_fingerprint=fingerprint)
        result = trainer.train(resume=resume)
    if trainer.accelerator.is_main_process:
        best = f"; best: {result.best_checkpoint} ({result.best['metric']}={result.best['value']:.4g})" \
            if result.best else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"trained {result.steps} steps, final loss {loss}; checkpoint: {result.last_checkpoint}{best}")
    return result


def run_target_model(recipe: Recipe, layers: int) -> Target:
    """The target as training needs it: whole, or its head and last ``layers`` layers when capture engines run it.
    (targets.load_target is looked up when called, so a caller, a test, may swap the loader.)"""
    return process_target(recipe, keep_last=layers) if engine_runs_target(recipe) else targets.load_target(recipe.target)


def start_weights(target: Target, layers: int = 1) -> list:
    """The target weights drafts start from (init_from_target): its embeddings, lm_head, final norm and last
    ``layers`` layers. Under ZeRO-3 only these are gathered while the draft is built, never the whole target."""
    model = target.model
    last = decoder_layers(model)[-layers:] if layers > 0 else []
    parts = [model.get_input_embeddings(), model.get_output_embeddings(), final_norm(model), *last]
    return list(dict.fromkeys(p for part in parts if part is not None for p in part.parameters()))


def check_split_is_current(run: RunFolder, dataset, target: Target) -> str:
    """The run folder's data must be what prepare recorded in data/manifest.json: the train split (hashed once
    here), tokenised with this target's tokenizer, and the validation split and prompts. Returns the train split's
    fingerprint, which every artifact built from it records."""
    manifest = DataManifest.read(run)
    fingerprint = split_fingerprint(dataset)
    validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
    tokenizer_id = target.tokenizer_fingerprint
    manifest.check(describe_run_data(run, fingerprint, validation, tokenizer_id, target.name), run)
    return fingerprint


def check_draft_vocab_is_current(recipe: Recipe, run: RunFolder, fingerprint: str, target: Target) -> None:
    """The run's draft vocab (written by `drafttrain prepare`) must come from this train split and tokenizer: a
    mapping left from other data would silently mask the wrong tokens."""
    if recipe.draft_vocab.enabled:
        load_draft_vocab(run.draft_vocab, expect_key=DraftVocabKey(fingerprint, target.tokenizer_fingerprint))


def checkpoint_callbacks(recipe: Recipe, target: Target, run: RunFolder) -> list:
    """Callbacks run after each checkpoint (fn(step, checkpoint_dir) -> metrics): held-out simulated tau and a
    real tau / speedup on held-out prompts, so the best checkpoint is kept by measured acceptance."""
    if not recipe.eval.every_checkpoint:
        return []

    validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
    return [CheckpointEvaluator(recipe, target, validation)]
