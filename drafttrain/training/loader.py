"""Training batches: a seeded, resumable data order and pad-collation.

The order of every epoch is a pure function of (seed, epoch), so a resumed run that skips the batches already
consumed sees exactly the batches the uninterrupted run would have seen. The order is defined over *global*
micro-batches (batch_size × world_size rows); rank r takes its slice of each, so all ranks always run the same
number of micro-batches (an uneven tail is dropped: ranks out of step would deadlock in a collective).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from drafttrain import DrafttrainError
from drafttrain.data.tokenize import length_grouped_order
from drafttrain.sources.base import ROW_INDEX  # batch key: each batch row's dataset row (sources read rows by it)

REQUIRED_COLUMNS = ("input_ids", "loss_mask")
OPTIONAL_COLUMNS = ("position_ids",)  # packed rows carry document-aware positions
# Used only to name rows in error messages; packed rows (drafttrain prepare, packing) list several conversations.
ID_COLUMNS = ("conversation_id", "conversation_ids", "id")


def epoch_entropy(seed: int, epoch: int) -> int:
    """64 bits that depend only on (seed, epoch), never on global RNG state: one epoch's data order is drawn from
    them."""
    entropy = np.random.SeedSequence([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch]).generate_state(2)
    return int(entropy[0]) << 32 | int(entropy[1])


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The data order of one epoch: depends only on (seed, epoch), never on global RNG state."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(epoch_entropy(seed, epoch)))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How rows are cut into micro-batches and optimizer steps (identical on every rank)."""

    num_rows: int
    batch_size: int  # per rank
    world_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def micro_batches_per_epoch(self) -> int:
        """Global micro-batches per epoch, cut to a whole number of optimizer steps."""
        return self.steps_per_epoch * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch // self.grad_accum

    def check(self) -> None:
        if self.steps_per_epoch == 0:
            raise DrafttrainError(
                f"the training set has {self.num_rows} rows, fewer than one optimizer step needs "
                f"(batch_size {self.batch_size} × {self.world_size} processes × gradient_accumulation "
                f"{self.grad_accum} = {self.global_batch * self.grad_accum}): lower them or add data"
            )


def grouped_permutation(lengths: Sequence[int], global_batch: int, seed: int, epoch: int) -> torch.Tensor:
    """One epoch's order with rows of similar length in each global micro-batch (every rank's share of it alike):
    like :func:`epoch_permutation`, it depends only on (seed, epoch)."""
    return torch.tensor(length_grouped_order(lengths, global_batch, epoch_entropy(seed, epoch) >> 32),
                        dtype=torch.long)


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's row indices for each micro-batch of one epoch, starting at ``start`` (a global
    micro-batch index, i.e. how many micro-batches of the epoch were already consumed). With ``lengths`` (the rows'
    token counts), micro-batches hold rows of similar length (training.group_by_length)."""

    def __init__(self, layout: BatchLayout, seed: int, epoch: int, rank: int, start: int = 0,
                 lengths: Sequence[int] | None = None):
        if not 0 <= start <= layout.micro_batches_per_epoch:
            raise ValueError(f"start {start} outside the epoch's {layout.micro_batches_per_epoch} micro-batches")
        self.layout, self.seed, self.epoch, self.rank, self.start = layout, seed, epoch, rank, start
        self.lengths = lengths

    def __len__(self) -> int:
        return self.layout.micro_batches_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        order = (epoch_permutation(self.layout.num_rows, self.seed, self.epoch) if self.lengths is None
                 else grouped_permutation(self.lengths, self.layout.global_batch, self.seed, self.epoch))
        size, glob = self.layout.batch_size, self.layout.global_batch
        for micro in range(self.start, self.layout.micro_batches_per_epoch):
            first = micro * glob + self.rank * size
            yield order[first : first + size].tolist()


class _IndexedRows(Dataset):
    """Rows of a ``datasets.Dataset`` restricted to the training columns, tagged with their row index."""

    def __init__(self, dataset, columns: Sequence[str]):
        self.dataset, self.columns = dataset, list(columns)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.dataset[int(index)]
        return {**{c: row[c] for c in self.columns}, ROW_INDEX: int(index)}


def training_columns(dataset) -> list[str]:
    """The columns training reads, of a ``datasets.Dataset`` or a list of row dicts."""
    names = list(getattr(dataset, "column_names", None) or (dataset[0] if len(dataset) else []))
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DrafttrainError(
            f"the training dataset lacks column(s) {missing} (has {names}): was it written by `drafttrain prepare`?"
        )
    return [*REQUIRED_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in names)]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated batch on ``device``: where the model runs, for training steps and held-out evaluation alike."""
    return {key: value.to(device) for key, value in batch.items()}


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens a collated batch trains: loss_mask set on a real (attended) position."""
    return int(((batch["loss_mask"] > 0) * batch["attention_mask"]).sum())


def pad_collate(rows: list[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row of the batch; padding has loss_mask 0 and attention_mask 0."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch, longest), dtype=torch.long)
    attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    positions = torch.zeros((batch, longest), dtype=torch.long) if "position_ids" in rows[0] else None
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        if len(row["loss_mask"]) != n:
            raise DrafttrainError(f"row {row[ROW_INDEX]}: loss_mask has {len(row['loss_mask'])} entries, input_ids {n}")
        input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        loss_mask[i, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
        attention_mask[i, :n] = 1
        if positions is not None:
            positions[i, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
    out = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        ROW_INDEX: torch.tensor([r[ROW_INDEX] for r in rows], dtype=torch.long),
    }
    if positions is not None:
        out["position_ids"] = positions
    return out


def epoch_loader(
    dataset, layout: BatchLayout, seed: int, epoch: int, rank: int, start: int, num_workers: int, pad_id: int,
    lengths: Sequence[int] | None = None,
) -> DataLoader:
    """The DataLoader for (the rest of) one epoch on this rank; ``lengths``: micro-batches of similar lengths."""
    sampler = ResumableBatchSampler(layout, seed, epoch, rank, start, lengths)
    return DataLoader(
        _IndexedRows(dataset, training_columns(dataset)),
        batch_sampler=sampler,
        collate_fn=functools.partial(pad_collate, pad_id=pad_id),  # picklable for spawned workers
        num_workers=num_workers,
        # An own generator: creating the iterator draws a worker base seed, which must not consume the
        # global torch RNG (that would make a resumed run's dropout masks differ from the uninterrupted run).
        generator=torch.Generator().manual_seed(seed + epoch),
        persistent_workers=False,
    )


def row_ids(dataset, indices: Sequence[int]) -> list[str]:
    """Conversation ids of the given rows, for error messages (row numbers when the set has no id column)."""
    column = next((c for c in ID_COLUMNS if c in (getattr(dataset, "column_names", None) or [])), None)
    if column is None:
        return [f"row {i}" for i in indices]
    values = [dataset[int(i)][column] for i in indices]
    return ["+".join(map(str, v)) if isinstance(v, list) else str(v) for v in values]
