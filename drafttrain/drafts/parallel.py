"""Parallel drafting's shared pieces: several draft tokens from one forward, by *mask slots* after the accepted text.
P-EAGLE (drafttrain.drafts.peagle) and PARD (drafttrain.drafts.pard) both train with them.

A mask slot at depth d after anchor a (the last real position) sits at position a + d, holds the mask token and sees
the real text up to a and its own rollout's earlier slots: k - 1 slots after the last real position draft tokens
2..k in the same forward that drafts token 1.

Training replaces one rollout per position with COD sampling (conditional drop): depth 0 is every position; depth d
keeps a random ``max(r^d, r_min)`` share of the rollouts that reached depth d - 1, so every kept rollout is
contiguous from its anchor and the sequence grows by a bounded factor instead of k.
"""

from __future__ import annotations

import dataclasses

import torch

from drafttrain.drafts.layers import RowMask


@dataclasses.dataclass
class Rollouts:
    """The mask slots of one row: each slot's anchor (the real position it continues) and depth (1..k-1)."""

    anchors: torch.Tensor
    depths: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.anchors + self.depths


def cod_rollouts(trainable: torch.Tensor, depths: int, ratio: float, floor: float,
                 generator: torch.Generator | None = None) -> Rollouts:
    """COD sampling for one row: ``trainable`` (T,) says which positions' depth-0 slot has a label (the seeds). Depth
    d keeps ``int((n - d) * max(ratio**d, floor))`` rollouts chosen at random among those that reached depth d - 1 and
    whose depth-d slot still has a label (n: the number of seeds)."""
    t = trainable.shape[0]
    if trainable.is_meta:  # `drafttrain plan`: shapes only, as many slots as a row that trains every position gets
        sizes = [int((t - d) * max(ratio**d, floor)) for d in range(1, depths)]
        levels = torch.cat([torch.full((n,), d, dtype=torch.long) for d, n in enumerate(sizes, 1)]).to("meta")
        return Rollouts(torch.zeros_like(levels), levels)
    seeds = torch.nonzero(trainable > 0).flatten()
    pool = seeds  # anchors whose rollout reached the previous depth
    anchors, levels = [], []
    for depth in range(1, depths):
        alive = pool[(pool + depth < t)]
        alive = alive[trainable[(alive + depth).clamp(max=t - 1)] > 0]
        wanted = min(int((seeds.numel() - depth) * max(ratio**depth, floor)), alive.numel())
        if wanted <= 0:
            break
        chosen = alive[torch.randperm(alive.numel(), generator=generator, device=alive.device)[:wanted]].sort().values
        anchors.append(chosen)
        levels.append(torch.full_like(chosen, depth))
        pool = chosen
    if not anchors:
        empty = torch.zeros(0, dtype=torch.long, device=trainable.device)
        return Rollouts(empty, empty)
    return Rollouts(torch.cat(anchors), torch.cat(levels))


class ParallelMask(RowMask):
    """Who sees whom among a row's T real pairs and S mask slots: real pair t sees real pairs <= t; a mask slot sees
    the real pairs up to its anchor and its own rollout's slots at depths <= its own (itself included). Built a block
    of query rows at a time, so a long row never holds the (T + S)^2 matrix (DraftAttention attends in chunks)."""

    def __init__(self, length: int, rollouts: Rollouts):
        device = rollouts.anchors.device
        self.anchors = torch.cat([torch.arange(length, device=device), rollouts.anchors])
        self.depths = torch.cat([torch.zeros(length, dtype=torch.long, device=device), rollouts.depths])

    @property
    def keys(self) -> int:
        return self.anchors.numel()

    def rows(self, start: int, end: int) -> torch.Tensor:
        anchors, depths = self.anchors[start:end, None], self.depths[start:end, None]
        real_key = self.depths[None, :] == 0
        sees_real = real_key & (self.anchors[None, :] <= anchors)
        same_rollout = (self.anchors[None, :] == anchors) & (self.depths[None, :] <= depths) & ~real_key
        return sees_real | same_rollout


def parallel_mask(length: int, rollouts: Rollouts) -> torch.Tensor:
    """The whole (T + S, T + S) mask of :class:`ParallelMask`, for a model that takes it whole (PARD's HF student)."""
    mask = ParallelMask(length, rollouts)
    return mask.rows(0, mask.keys)
