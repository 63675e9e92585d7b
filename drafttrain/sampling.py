"""The one sampling rule: temperature, then top-k, then top-p (HF's order), with its argument checks.

Used by regeneration (the target writing training answers), by the drafts proposing under sampling, and by
verification, so the target's ``p`` and the draft's ``q`` are always warped the same way.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from drafttrain import DrafttrainError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy. top_k 0 = off. top_p 1 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling(temperature, top_p=1.0, top_k=0) -> None:
    """Refuse values that would fail (or silently mean nothing) only later, deep inside decoding."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature >= 0
    ):
        raise DrafttrainError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise DrafttrainError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise DrafttrainError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest set of tokens whose probability reaches top_p (the token crossing it kept)."""
    if top_p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # the mass before this token already reaches top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def warp_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits / T with everything outside top-k and top-p at -inf (float32). Not for greedy sampling."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return keep_top_p(logits, sampling.top_p)


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The warped distribution over the last axis (float32)."""
    return warp_logits(logits, sampling).softmax(-1)


def top_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The draft's largest probability at each position of ``logits`` [..., V] (the unwarped softmax when greedy):
    what a confidence stop reads, never the token about to be drawn, so stopping on it keeps sampling lossless."""
    if sampling.greedy:
        return torch.softmax(logits.float(), dim=-1).amax(-1)
    return probabilities(logits, sampling).amax(-1)


def top_probability(logits: torch.Tensor, sampling: Sampling) -> float:
    """``top_probabilities`` of one position's logits [V]."""
    return float(top_probabilities(logits, sampling))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [..., V] -> LongTensor [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_without_replacement(q: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    """m distinct tokens per row of q [..., V], in draw order (Gumbel-top-k: rank q / Exp(1)) -> [..., m].
    Where q has fewer than m nonzero entries the missing draws are -1."""
    keys = q / torch.empty_like(q).exponential_(generator=generator)
    vals, idx = torch.topk(keys, min(m, q.shape[-1]), dim=-1)
    return idx.masked_fill(vals <= 0, -1)
