"""The held-out accuracy of a checkpoint, at any scale: per draft position, the share of the validation rows'
trainable tokens where the draft's top-1 is the target's, the τ that predicts, each per-token measure the kind
reports, and the loss. Every process runs its share of the rows through the module training runs (under ZeRO-3 the
sharded forward: every process must run as many rows as the others), with the target's outputs from the run's own
kind of source (sources/choose.py: HeldOut); the sums are added over processes."""

from __future__ import annotations

import torch

from drafttrain.drafts.base import simulated_tau
from drafttrain.sources.base import ROW_INDEX
from drafttrain.sources.choose import HeldOut
from drafttrain.training.loader import pad_collate, to_device, training_columns

# validation rows a checkpoint is measured on, at most: the accuracies' noise at that count is below what separates
# checkpoints, and the measure stays a small part of a checkpoint's time
HELD_OUT_ROWS = 256
HELD_OUT_SEED = 0  # the random draws of a kind's held-out forward, the same at every checkpoint


def rows_of(num_rows: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """This process's rows, (row, counted): every world-th row from ``rank``, padded with row 0 (not counted) so that
    every process runs as many rows as the others."""
    rows = min(num_rows, HELD_OUT_ROWS)
    per_process = -(-rows // world)
    return [(i, True) if i < rows else (0, False) for i in range(rank, per_process * world, world)]


@torch.no_grad()
def held_out_accuracy(module, held_out: HeldOut, accelerator, pad_id: int) -> dict[str, float]:
    """The checkpoint's held-out figures (see the module docstring): ``val_acc_k``, ``sim_tau``, ``val_loss`` and
    ``val_<measure>``, the same on every process. Kinds that draw at random while training (DFlash's anchors) draw
    the same for every checkpoint, and training's own random state is left as it was: a resumed run, whose state
    was saved before this ran, goes on exactly as an uninterrupted one."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(HELD_OUT_SEED)
        return _held_out_sums(module, held_out, accelerator, pad_id)


def _held_out_sums(module, held_out: HeldOut, accelerator, pad_id: int) -> dict[str, float]:
    rows = rows_of(len(held_out.rows), accelerator.process_index, accelerator.num_processes)
    held_out.source.ask(row for row, _ in rows)
    columns = training_columns(held_out.rows)
    correct: list[float] = []
    counted: list[float] = []
    loss, measures = torch.zeros(2, dtype=torch.float64), {}
    for row, counts in rows:
        batch = pad_collate([{**{c: held_out.rows[row][c] for c in columns}, ROW_INDEX: row}], pad_id)
        out = module(to_device(batch, accelerator.device), source=held_out.source)
        weight = 1.0 if counts else 0.0  # a padding row adds nothing, but its sums keep every process's shape
        correct = [a + weight * b for a, b in zip(_padded(correct, len(out.correct)), out.correct)]
        counted = [a + weight * b for a, b in zip(_padded(counted, len(out.counted)), out.counted)]
        loss += weight * torch.tensor([float(out.loss), 1.0], dtype=torch.float64)
        for name, (total, part) in out.measures.items():
            measures[name] = [a + weight * b for a, b in zip(measures.get(name, (0.0, 0.0)), (total, part))]
    return _summed(accelerator, correct, counted, loss, measures)


def _padded(values: list[float], length: int) -> list[float]:
    return values + [0.0] * (length - len(values))


def _summed(accelerator, correct, counted, loss, measures) -> dict[str, float]:
    """The sums over every process, as the checkpoint's figures."""
    names = sorted(measures)
    flat = torch.tensor([*correct, *counted, *loss.tolist(), *(v for n in names for v in measures[n])],
                        dtype=torch.float64)
    if accelerator.num_processes > 1:
        flat = accelerator.reduce(flat.to(accelerator.device), reduction="sum").cpu()
    k = len(correct)
    correct, counted, (loss_sum, rows) = flat[:k].tolist(), flat[k:2 * k].tolist(), flat[2 * k:2 * k + 2].tolist()
    accuracies = [c / n if n else 0.0 for c, n in zip(correct, counted)]
    figures = {"sim_tau": simulated_tau(accuracies), "val_loss": loss_sum / max(rows, 1.0),
               **{f"val_acc_{i}": a for i, a in enumerate(accuracies)}}
    sums = flat[2 * k + 2:].tolist()
    for i, name in enumerate(names):
        total, weight = sums[2 * i], sums[2 * i + 1]
        if weight:
            figures[f"val_{name}"] = total / weight
    return figures
