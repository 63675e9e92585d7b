"""Every loss a draft kind trains with, in one place.

Conventions: ``p`` is the target's (teacher's) distribution, ``q`` the draft's (student's); both come as logits over
the same vocabulary on the last axis and are softened by the same ``temperature``. ``weight`` [...] (the loss
mask, 0/1 or fractional) weighs the positions; every loss is the weighted mean over positions,
Σ loss_t · w_t / Σ w_t (0 when no position has weight). Computed in float32.

* ``cross_entropy``: hard labels, -log q(y).
* ``soft_cross_entropy``: -Σ p log q (EAGLE's loss against the target's distribution; = H(p) + KL(p‖q)).
* ``forward_kl``: KL(p‖q) = Σ p (log p − log q) (mass-covering).
* ``reverse_kl``: KL(q‖p) = Σ q (log q − log p) (mode-seeking).
* ``jsd``: JSD_β = β·KL(p‖m) + (1−β)·KL(q‖m) with m = β·p + (1−β)·q; β = 0.5 is the symmetric
  Jensen–Shannon divergence, β → 0 behaves like forward KL and β → 1 like reverse KL (scaled), as in DistillSpec/GKD.
* ``total_variation``: ½ Σ |p − q|. 1 − TVD is the acceptance probability of one drafted token under
  speculative sampling (Leviathan et al.), which is what a draft is paid for.
* ``smooth_l1``: feature regression (EAGLE-1), mean over the feature axis.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def masked_mean(per_position: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    weight = weight.to(per_position.dtype)
    return (per_position * weight).sum() / weight.sum().clamp(min=1e-12)  # 0 when nothing has weight


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    per = -log_probs(logits, temperature).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return masked_mean(per, weight)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) per position from log-probabilities (0·log 0 = 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def per_position(name: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Divergence ``name`` at every position, from the draft's (q) and the target's (p) log-probabilities."""
    if name == "fkl":
        return _kl(log_p, log_q)
    if name == "rkl":
        return _kl(log_q, log_p)
    if name == "jsd":
        if not 0 < beta < 1:
            raise ValueError(f"jsd: beta must be in (0, 1), got {beta}")
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    if name == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    if name == "soft_ce":
        return -(log_p.exp() * log_q).sum(-1)
    raise ValueError(f"unknown divergence {name!r}: one of {', '.join(DIVERGENCES)}")


def divergence(name: str, logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor,
               temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    return masked_mean(per_position(name, log_probs(logits, temperature), log_probs(target_logits, temperature),
                                    beta), weight)


def soft_cross_entropy(logits, target_logits, weight, temperature: float = 1.0) -> torch.Tensor:
    return divergence("soft_ce", logits, target_logits, weight, temperature)


def forward_kl(logits, target_logits, weight, temperature: float = 1.0) -> torch.Tensor:
    return divergence("fkl", logits, target_logits, weight, temperature)


def reverse_kl(logits, target_logits, weight, temperature: float = 1.0) -> torch.Tensor:
    return divergence("rkl", logits, target_logits, weight, temperature)


def jsd(logits, target_logits, weight, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    return divergence("jsd", logits, target_logits, weight, temperature, beta)


def total_variation(logits, target_logits, weight, temperature: float = 1.0) -> torch.Tensor:
    return divergence("tvd", logits, target_logits, weight, temperature)


def top_k_buckets(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the k candidates ``ids`` [..., k] and of everything else (one more bucket): how a
    full distribution meets a teacher stored as its top-k (an offline teacher cache)."""
    chosen = log_probs(logits, temperature).gather(-1, ids)
    rest = torch.log1p(-chosen.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-6))
    return torch.cat([chosen, rest], dim=-1)


def smooth_l1(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    per = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    return masked_mean(per, weight)


DIVERGENCES = {
    "fkl": forward_kl,
    "rkl": reverse_kl,
    "jsd": jsd,
    "tvd": total_variation,
    "soft_ce": soft_cross_entropy,
}
