"""Attention masks handed to an unmodified HF model: the one rule for a 4D mask transformers passes through."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A 4D float mask [1, 1, q, prefix_len + k] from ``allowed`` [q, k]: every query sees the whole cached
    prefix, and of the k new keys only those allowed. Float (0 / dtype-min) works for both sdpa and eager
    attention; transformers passes a 4D mask through untouched (masking_utils._preprocess_mask_arguments)."""
    q, k = allowed.shape
    mask = torch.zeros(q, prefix_len + k, dtype=dtype, device=device)
    mask[:, prefix_len:].masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]
