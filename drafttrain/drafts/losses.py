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

import torch
import torch.nn.functional as F


def masked_mean(per_position: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    weight = weight.to(per_position.dtype)
    return (per_position * weight).sum() / weight.sum().clamp(min=1e-12)  # 0 when nothing has weight


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    per = -_log_probs(logits, temperature).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return masked_mean(per, weight)


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    p = _log_probs(target_logits, temperature).exp()
    return masked_mean(-(p * _log_probs(logits, temperature)).sum(-1), weight)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) per position from log-probabilities (0·log 0 = 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    return masked_mean(_kl(_log_probs(target_logits, temperature), _log_probs(logits, temperature)), weight)


def reverse_kl(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    return masked_mean(_kl(_log_probs(logits, temperature), _log_probs(target_logits, temperature)), weight)


def jsd(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0,
        beta: float = 0.5) -> torch.Tensor:
    if not 0 < beta < 1:
        raise ValueError(f"jsd: beta must be in (0, 1), got {beta}")
    log_p, log_q = _log_probs(target_logits, temperature), _log_probs(logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + torch.log(torch.tensor(beta)),
                                         log_q + torch.log(torch.tensor(1 - beta))]), dim=0)
    return masked_mean(beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m), weight)


def total_variation(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    p, q = _log_probs(target_logits, temperature).exp(), _log_probs(logits, temperature).exp()
    return masked_mean(0.5 * (p - q).abs().sum(-1), weight)


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
