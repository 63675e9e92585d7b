"""P-EAGLE: an EAGLE-3 head that drafts several tokens in one forward (the EAGLE-3 kind's ``parallel_depths`` option,
as speculators' ``peagle`` and SpecForge's ``peagle`` train it).

After the accepted text (pairs of a target state and the next token, as EAGLE-3 reads them), a proposal appends
k - 1 *mask slots*: the mask token's embedding (a learned row) and a learned hidden input ``mask_hidden`` (through the
same fc as real taps), at the next positions, attending causally to the text and the earlier mask slots. The last
real pair predicts draft token 1, mask slot d predicts draft token d + 1: k tokens from one forward.

Training replaces the training-time test with COD sampling (conditional drop): depth 0 is every position (ordinary
EAGLE-3 step 0); depth d keeps a random ``max(r^d, r_min)`` share of the rollouts that reached depth d - 1, so every
kept rollout is contiguous from its anchor and the sequence grows by a bounded factor instead of k. A slot of anchor
a at depth d sits at position a + d and sees the real pairs up to a and its own rollout's earlier slots; its label is
the target's distribution for token a + d + 2.
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
