"""Evaluation at every checkpoint: simulated τ from the head's per-step accuracy on held-out rows, and a real τ
(plus speedup against plain decoding in the same run) from the speculative-decoding evaluator."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from drafttrain.config import Recipe
from drafttrain.drafts import load_draft
from drafttrain.evaluation.metrics import simulated_tau
from drafttrain.training.features import compute_features
from drafttrain.training.loader import ROW_INDEX, pad_collate

log = logging.getLogger(__name__)


def evaluate_head(recipe: Recipe, target, head, questions, progress: bool = True):
    """The evaluator on ``questions`` with the recipe's eval settings, against plain decoding in the same run."""
    from drafttrain.decoding.trees import DynamicTree
    from drafttrain.evaluation.evaluate import evaluate

    cfg = recipe.eval
    tree = "chain" if cfg.tree == "chain" else DynamicTree(depth=cfg.depth)
    return evaluate(
        target, cfg.proposer or head.kind, questions, depth=cfg.depth, tree=tree, temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens, seed=recipe.seed, proposer_kwargs={"draft": head}, progress=progress,
    )


class CheckpointEvaluator:
    """``fn(step, checkpoint_dir) -> metrics`` for Trainer callbacks (main process only)."""

    def __init__(self, recipe: Recipe, target, validation=None, max_rows: int = 16):
        from drafttrain.evaluation.suites import load_suite

        self.recipe, self.target = recipe, target
        self.validation = validation.select(range(min(max_rows, len(validation)))) if validation else None
        self.questions = load_suite(recipe.eval.suite).select(num_prompts=recipe.eval.num_prompts, turns="1")

    @torch.no_grad()
    def held_out_accuracies(self, head) -> list[float]:
        """Per unrolled step, the share of held-out trainable tokens where the head's argmax is the target's."""
        hits, counts = None, 0.0
        for row in range(len(self.validation)):
            batch = pad_collate([{**self.validation[row], ROW_INDEX: row}])
            features = compute_features(self.target, batch, head.target_layers)
            out = head.training_step(batch, features)
            weight = float(batch["loss_mask"][:, 2:].sum())
            accs = torch.tensor(out.step_accuracies) * weight
            hits = accs if hits is None else hits + accs
            counts += weight
        return (hits / max(counts, 1.0)).tolist() if hits is not None else []

    def __call__(self, step: int, checkpoint: Path) -> dict[str, float]:
        from drafttrain.evaluation.report import write_report

        head = load_draft(checkpoint, self.target).eval()
        metrics: dict[str, float] = {}
        if self.validation is not None and len(self.validation):
            accs = self.held_out_accuracies(head)
            metrics["sim_tau"] = simulated_tau(accs)
            metrics.update({f"val_acc_{i}": a for i, a in enumerate(accs)})
        report = evaluate_head(self.recipe, self.target, head, self.questions, progress=False)
        write_report(report, checkpoint / "eval")
        overall = report.overall
        metrics.update({k: float(overall[k]) for k in ("tau", "acceptance_rate", "speedup") if overall.get(k) is not None})
        if overall.get("greedy_match") is not None:
            metrics["greedy_match"] = float(overall["greedy_match"])
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if not k.startswith("val_")))
        return metrics
