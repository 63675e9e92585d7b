"""Evaluation at every checkpoint, to keep the best one.

A real τ / speedup from the evaluator, against plain decoding in the same run (the held-out accuracy at each draft
position, and the τ it predicts, is every run's: training/held_out.py, in the sharded forward). The real τ is measured on the first turns
of the run's *validation* conversations (``data/validation_prompts.jsonl``, written by prepare), never on the
suite the final report uses (``eval.suite``): a checkpoint chosen on the prompts it is then reported on would be
reported too well. Prompts that also occur in the reported suite are left out of the selection slice.

Nothing here knows a draft kind: the held-out accuracy comes from the kind's own training step on the target
outputs it declares, and the evaluator serves the draft with the proposer its kind names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from drafttrain import DrafttrainError
from drafttrain.config import DecodeSettings, Recipe
from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.decoding import plain_decode
from drafttrain.decoding.trees import check_tree_depth, tree_of
from drafttrain.drafts import drafter_for, load_drafter
from drafttrain.drafts.layers import shift_left
from drafttrain.drafts.losses import cross_entropy
from drafttrain.evaluation.evaluate import EvalReport, evaluate
from drafttrain.evaluation.report import write_report
from drafttrain.evaluation.sides import Compared
from drafttrain.evaluation.suites import Suite, load_suite, served_kind, without_reported
from drafttrain.runfolder import EVAL_DIR, RunFolder
from drafttrain.sources.choose import HeldOut
from drafttrain.sources.hf import HFForward
from drafttrain.targets import Target, TargetNeeds
from drafttrain.targets.outputs import run_target
from drafttrain.training.held_out import held_out_accuracy
from drafttrain.training.loader import ROW_INDEX, pad_collate, to_device
from drafttrain.training.run_log import CheckpointMetrics
from drafttrain.training.trainer import TrainStep

log = logging.getLogger(__name__)

CALIBRATION_PROMPTS = 4  # held-out prompts that depth auto measures acceptance on


def evaluate_drafter(recipe: Recipe, target: Target, drafter, questions: Suite, progress: bool = True,
                     calibration: Suite | None = None, time_budget_s: float | None = None, depth: int | None = None,
                     compare: Sequence[Compared] = ()) -> EvalReport:
    """The evaluator on ``questions`` with the recipe's eval settings, against plain decoding in the same run.
    With ``eval.depth: auto`` the depth is chosen on ``calibration`` (default: the questions' own suite's prompts
    that are not reported, the served kind; else the held-out validation prompts). ``depth``: this depth instead of
    the recipe's; ``compare``: more sides on the same prompts (a depth-auto one is calibrated like the method)."""
    if calibration is None:
        served = served_kind(questions, CALIBRATION_PROMPTS)
        fallback = selection_prompts(recipe)
        chosen = served or (fallback.questions[:CALIBRATION_PROMPTS] if fallback else ())
    else:
        chosen = calibration.questions[:CALIBRATION_PROMPTS]
    settings = recipe.eval.fitted_to(type(drafter).max_draft_depth(drafter.config)).decode_settings()
    if depth is not None:
        settings = DecodeSettings.of(settings, depth=depth)
    return evaluate(target, drafter, questions, settings, progress=progress, calibration=chosen,
                    time_budget_s=time_budget_s, compare=compare)


def check_eval_shape(recipe: Recipe) -> None:
    """The recipe's eval tree parsed, and no deeper than its draft can fill. Called before training starts, so
    a mistake costs nothing."""
    limit = drafter_for(recipe.draft).max_draft_depth(recipe.draft) if recipe.draft is not None else None
    settings = recipe.eval.fitted_to(limit)  # a default depth fits the draft; a depth the recipe gives is checked
    check_tree_depth(recipe.eval, "eval.depth", "eval.tree")
    tree = tree_of(settings)
    if recipe.draft is None or tree == "auto":  # "auto" is built no deeper than the draft can fill
        return
    deepest = getattr(tree, "depth", None) if not isinstance(tree, (str, list)) else None
    deepest = deepest or settings.deepest
    if limit is not None and deepest > limit:
        raise DrafttrainError(f"eval: a draft of depth {deepest} (eval.tree {recipe.eval.tree}, eval.depth "
                              f"{recipe.eval.depth}) is deeper than this {recipe.draft.kind} draft can fill ({limit})")


def selection_prompts(recipe: Recipe, num_prompts: int | None = None) -> Suite | None:
    """The held-out prompts a checkpoint is chosen on: validation first turns not in the reported suite (the first
    ``num_prompts``, default eval.num_prompts, taken a category at a time)."""
    path = RunFolder.of(recipe.output_dir).validation_prompts
    if not path.is_file():
        return None
    candidates = load_suite(path)
    kept = without_reported(candidates, load_suite(recipe.eval.suite))
    if len(kept.questions) < len(candidates.questions):
        log.warning("%d validation prompt(s) also occur in %s and are not used to choose checkpoints",
                    len(candidates.questions) - len(kept.questions), recipe.eval.suite)
    if not kept.questions:
        return None
    return kept.select(num_prompts=num_prompts or recipe.eval.num_prompts, turns="1")


class CheckpointEvaluator:
    """``fn(step, checkpoint_dir) -> metrics`` for Trainer callbacks (main process only)."""

    def __init__(self, recipe: Recipe, target: Target, validation=None, max_rows: int = 16):
        self.recipe, self.target = recipe, target
        self.validation = validation.select(range(min(max_rows, len(validation)))) if validation else None
        self.questions = selection_prompts(recipe)
        if self.questions is None:
            log.warning("no held-out validation prompts in %s: checkpoints get no real τ, and the best one is not "
                        "chosen by it (set data.validation_fraction > 0)", recipe.output_dir)

    @torch.no_grad()
    def target_drift(self, drafter) -> dict[str, float]:
        """How far a draft that adapts its target (Medusa-2) moved it from the original: perplexity on the
        held-out rows with and without the adapters, and how many held-out prompts get the same greedy answer."""
        def perplexity() -> float:
            total, weight = 0.0, 0.0
            for row in range(len(self.validation or [])):
                batch = row_batch(self.validation, row, self.target.device)
                logits = run_target(self.target, batch, TargetNeeds(logits=True)).logits
                mask = shift_left(batch["loss_mask"].float(), 1)
                total += float(cross_entropy(logits, shift_left(batch["input_ids"], 1), mask)) * float(mask.sum())
                weight += float(mask.sum())
            return float(torch.exp(torch.tensor(total / max(weight, 1.0))))

        def answers() -> list[list[int]]:
            stops = set(stop_token_ids(self.target.tokenizer, self.target.model.generation_config))
            return [plain_decode(self.target, [prompt_ids(self.target.tokenizer, [{"role": "user", "content": q.turns[0]}])],
                                 self.recipe.eval.max_new_tokens, stop_token_ids=stops).tokens
                    for q in (self.questions.questions if self.questions else ())]

        adapted_ppl, adapted = perplexity(), answers()
        with drafter.original_target():
            original_ppl, original = perplexity(), answers()
        drift = {"target_perplexity": adapted_ppl, "original_perplexity": original_ppl}
        if adapted:
            drift["greedy_match_vs_original"] = sum(a == b for a, b in zip(adapted, original)) / len(adapted)
        return drift

    def __call__(self, step: int, checkpoint: Path) -> CheckpointMetrics:
        drafter = load_drafter(checkpoint, self.target).eval()
        metrics: dict[str, float] = {}
        measured = CheckpointMetrics(metrics)
        if drafter.adapts_target:
            metrics.update(self.target_drift(drafter))
        if self.questions is not None:
            minutes = self.recipe.eval.checkpoint_budget_minutes
            report = evaluate_drafter(self.recipe, self.target, drafter, self.questions, progress=False,
                                      calibration=self.questions, time_budget_s=None if minutes is None else 60 * minutes)
            paths = write_report(report, checkpoint / EVAL_DIR)
            measured.merge(dashboard_metrics(report, paths["plot"]))
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                                                if not k.startswith(("val_acc_", "acceptance_"))))
        return measured


def row_batch(rows, row: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Held-out row ``row`` as a batch of one on the target's device, as the training loop gives its batches (a
    batch left on the CPU broke the first checkpoint's evaluation on a GPU)."""
    return to_device(pad_collate([{**rows[row], ROW_INDEX: row}]), device)


@dataclasses.dataclass(frozen=True)
class OneProcess:
    """What the held-out measure asks of an accelerator, for a draft measured in one process."""

    device: torch.device
    process_index: int = 0
    num_processes: int = 1


@torch.no_grad()
def held_out(drafter, target: Target, rows) -> tuple[list[float], dict[str, float]]:
    """On held-out ``rows`` (tokenised rows, a dataset), in this process: per draft position, the share of trainable
    tokens where the draft's top-1 is the target's; and each per-token measure the kind reports (a draft model's
    β = 1 - TVD), over all the rows' tokens (training/held_out.py, which training runs in its sharded forward)."""
    source = HFForward(target, drafter.held_out_needs())
    figures = held_out_accuracy(TrainStep(drafter, target, source), HeldOut(rows, source), OneProcess(target.device),
                                pad_id=0)
    accuracies = [figures[f"val_acc_{i}"] for i in range(sum(k.startswith("val_acc_") for k in figures))]
    measures = {k.removeprefix("val_"): v for k, v in figures.items()
                if k.startswith("val_") and not k.startswith("val_acc_") and k != "val_loss"}
    return accuracies, measures


def dashboard_metrics(report: EvalReport, plot: Path | None = None) -> CheckpointMetrics:
    """A report as dashboard entries: τ, acceptance, speedup, greedy match; acceptance at each depth k
    (``acceptance_cond_k`` = P(k | k-1), ``acceptance_cum_k`` = P(k)); per-category numbers as a table; the plot."""
    overall = report.overall
    scalars = {k: float(overall[k]) for k in ("tau", "acceptance_rate", "speedup", "greedy_match")
               if overall.get(k) is not None}
    per_position = overall["acceptance_per_position"]
    for kind, key in (("conditional", "cond"), ("cumulative", "cum")):
        scalars.update({f"acceptance_{key}_{k}": float(v) for k, v in enumerate(per_position[kind], 1)
                        if v is not None})
    scalars.update({f"tau_context_{b['bucket']}": float(b["tau"]) for b in overall.get("by_context") or []})
    columns = ["category", "prompts", "tau", "acceptance_rate", "speedup", "greedy_match"]
    rows = [[name, m["num_prompts"], *(m.get(c) for c in columns[2:])]
            for name, m in {"overall": overall, **report.categories}.items()]
    return CheckpointMetrics(scalars, tables={"categories": (columns, rows)},
                             images={"acceptance": plot} if plot is not None else {})
