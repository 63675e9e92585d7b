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
from drafttrain.serving.checkpoint_engine import EngineCheckpoints, check_engine, served_format
from drafttrain.serving.gate import check_gate, run_gate
from drafttrain.sources.choose import engine_runs_target, process_target, training_sources
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

    zero3 = configured_zero_stage(recipe.training) == 3
    if zero3:
        check_zero3(recipe.draft.kind, recipe.draft.trains_target)
    check_checkpoint_evaluation(recipe, zero3)
    run = RunFolder.of(recipe.output_dir)
    if not run.train_split.is_dir():
        raise DrafttrainError(
            f"no prepared training data at {run.train_split}: run `drafttrain prepare` with this recipe first"
        )
    return draft


def check_checkpoint_evaluation(recipe: Recipe, zero3: bool) -> None:
    """drafttrain's evaluator at every checkpoint needs the whole target in this process; the engine (eval.engine)
    holds the target itself, so it measures checkpoints under ZeRO-3 and beside capture engines too."""
    engine = recipe.eval.engine != "none"
    if recipe.eval.every_checkpoint and zero3 and not engine:
        raise DrafttrainError(
            "eval.every_checkpoint decodes with the whole target in one process, which ZeRO-3 partitions over "
            "all of them: set eval.every_checkpoint: false and measure checkpoints in the engine (eval.engine: "
            "vllm), or with `drafttrain eval` on a machine that holds the target")
    if recipe.eval.every_checkpoint and engine_runs_target(recipe) and not engine:
        raise DrafttrainError(
            "eval.every_checkpoint decodes with the whole target in this process, and with capture.engine "
            f"{recipe.capture.engine} the trainers hold only its head: set eval.every_checkpoint: false, or measure "
            "checkpoints in the engine (eval.engine: vllm)")
    if recipe.eval.every_checkpoint and holds_whole_target(recipe, zero3):
        check_eval_shape(recipe)
    if engine or recipe.eval.gate:
        check_engine(recipe)
    if recipe.eval.gate:
        check_gate(recipe, holds_whole_target(recipe, zero3))


def holds_whole_target(recipe: Recipe, zero3: bool) -> bool:
    """Whether a training process holds the whole target, as drafttrain's evaluator needs it."""
    return not zero3 and not engine_runs_target(recipe)


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
    if recipe.eval.gate and first_of_launch():  # before the long run: what it trains is what the engine serves
        run_gate(recipe, draft, target)
    callbacks = checkpoint_callbacks(recipe, target, run, zero3)
    validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
    with training_sources(recipe, target, drafter.needs(), dataset, fingerprint, validation,
                          drafter.held_out_needs()) as (source, held_out):
        # the best checkpoint by a real tau where one is measured, else by the tau the held-out accuracy predicts
        best_metric = best_metric_of(recipe, drafter, holds_whole_target(recipe, zero3), held_out is not None)
        trainer = Trainer(recipe, target, drafter, dataset, source=source, callbacks=callbacks,
                          best_metric=best_metric, accelerator=accelerator, data_fingerprint=fingerprint,
                          held_out=held_out)
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


def checkpoint_callbacks(recipe: Recipe, target: Target, run: RunFolder, zero3: bool = False) -> list:
    """Callbacks run after each checkpoint (fn(step, checkpoint_dir) -> metrics), so the best checkpoint is kept by
    measured acceptance: drafttrain's evaluator (eval.every_checkpoint: real tau and speedup on held-out prompts,
    where this process holds the whole target) and the serving engine (eval.engine, inline)."""
    whole, callbacks = holds_whole_target(recipe, zero3), []
    if recipe.eval.every_checkpoint and whole:
        validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
        callbacks.append(CheckpointEvaluator(recipe, target, validation))
    elif recipe.eval.every_checkpoint:
        log.info("eval.every_checkpoint: drafttrain's evaluator needs the whole target in one process, which this "
                 "run's are not; the engine (eval.engine) measures real acceptance instead")
    if recipe.eval.engine != "none" and recipe.eval.engine_settings.inline:
        # a partitioned target cannot export a checkpoint: the engine's callback loads the target's head instead
        callbacks.append(EngineCheckpoints(recipe, None if zero3 else target, whole,
                                           own_evaluator=bool(callbacks)))
    return callbacks


def best_metric_of(recipe: Recipe, drafter, whole: bool, held_out: bool) -> str | None:
    """What the best checkpoint is kept by: the recipe's training.best_metric; else drafttrain's real tau where its
    evaluator measures every checkpoint (eval.every_checkpoint, the whole target here); else the engine's tau
    (eval.engine, or drafttrain's tau where the engine serves this draft from no format and the target is whole
    here); else the tau the held-out accuracy predicts."""
    if recipe.training.best_metric:
        return recipe.training.best_metric
    if recipe.eval.every_checkpoint and whole:
        return "tau"
    if recipe.eval.engine != "none" and served_format(drafter, recipe.eval.engine_settings) is not None:
        return "engine_tau"
    if recipe.eval.engine != "none" and whole:
        return "tau"
    return "sim_tau" if held_out else None
