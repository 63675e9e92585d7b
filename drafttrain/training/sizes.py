"""The sizes the plan's parts share: the units and estimates (:data:`CUDA_CONTEXT`, :data:`SLACK`), how a size is
written, and what the target's cache takes for a number of tokens."""

from __future__ import annotations

import math

import torch

from drafttrain.config import Recipe
from drafttrain.targets.cache_kinds import cache_bytes
from drafttrain.targets.loading import Target

GIB = 2**30
CUDA_CONTEXT = int(1.0 * GIB)  # CUDA context + cuBLAS workspace + allocator slack: an estimate, not measured here
SLACK = 0.8  # the estimate is good to about 20%: a run "clearly cannot fit" when even 80% of it exceeds the memory


def within(need: int | None, room: int | None) -> bool:
    """A need within the room there is (either unknown: not refused)."""
    return need is None or room is None or need <= room


def clearly_exceeds(need: int | None, room: int | None) -> bool:
    """Even :data:`SLACK` of the need exceeds the room: a run to refuse before any work."""
    return need is not None and room is not None and SLACK * need > room


def _size(n: int | float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _on_gpu(recipe: Recipe) -> bool:
    return recipe.target.device.startswith("cuda")


def _cache_bytes(target: Target, tokens: int, dtype: torch.dtype | None = None, tensor: int = 1,
                 pipeline: int = 1) -> int:
    """What one sequence of ``tokens`` leaves in the target's cache, by each layer's cache kind
    (targets/cache_kinds.py), in the target's dtype (or ``dtype``); over ``tensor`` x ``pipeline`` ranks, one GPU's
    share: its stage's layers (the widest stage) and its heads."""
    per_layer = [positions + states for _, positions, states in
                 cache_bytes(target.model, tokens, (dtype or target.model.dtype).itemsize, tensor)]
    stage = math.ceil(len(per_layer) / pipeline)
    return max(sum(per_layer[i:i + stage]) for i in range(0, len(per_layer), stage))
