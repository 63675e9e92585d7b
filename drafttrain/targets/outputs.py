"""What a draft learns from: the target outputs a draft kind declares it needs, computed in one target forward.

A kind declares its needs as :class:`TargetNeeds`: hidden states at named layers (taps), the final hidden state
(the lm_head's input), the next-token logits, or nothing at all (a distilled draft model that brings its own data
from a teacher cache). :func:`run_target` produces them online; an offline cache stores the hidden states once and
recovers the logits with :func:`logits_from_final`, through the target's own output path, so final-logit scaling
and softcapping (Gemma-2/3, Granite, Cohere) are applied exactly as the model applies them.

Gradients follow the target's parameters: when none requires grad (the frozen default) no graph is built; a kind
that trains part of the target (LoRA) gets the graph through these outputs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from drafttrain.targets.hidden import HiddenStateTap


@dataclasses.dataclass(frozen=True)
class TargetNeeds:
    """The target outputs a draft trains on (see the module docstring)."""

    layers: tuple[int, ...] = ()  # HF hidden_states indices (i = input of layer i, L = final), concatenated
    final_hidden: bool = False
    logits: bool = False
    # An offline cache keeps the logits as their top-k (with the log-probability of everything else), at this
    # temperature, instead of recomputing them: a teacher cache (a 70B teacher runs once). None: recompute.
    logits_top_k: int | None = None
    logits_temperature: float = 1.0

    @property
    def runs_target(self) -> bool:
        return bool(self.layers) or self.final_hidden or self.logits

    def stored_layers(self, num_layers: int) -> list[int]:
        """The distinct hidden states an offline cache keeps: the taps, and the final one when the final hidden
        state or the logits (recomputed, not cached as top-k) are needed (each layer once, ascending)."""
        wanted = set(self.layers)
        if self.final_hidden or (self.logits and self.logits_top_k is None):
            wanted.add(num_layers)
        return sorted(wanted)


@dataclasses.dataclass
class TopK:
    """A distribution kept as its k likeliest tokens: ``ids`` and ``log_probs`` (B, T, k) and ``rest`` (B, T, 1),
    the log-probability of all other tokens (drafttrain.drafts.losses.top_k_buckets meets it)."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    rest: torch.Tensor

    @property
    def buckets(self) -> torch.Tensor:
        return torch.cat([self.log_probs, self.rest], dim=-1)


def top_k_of(logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopK:
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = log_probs.topk(k, dim=-1)
    rest = torch.log1p(-values.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-6))
    return TopK(ids=ids, log_probs=values, rest=rest)


@dataclasses.dataclass
class TargetOutputs:
    hidden: torch.Tensor | None = None  # (B, T, len(layers) * H): the taps in the order declared
    final: torch.Tensor | None = None  # (B, T, H)
    logits: torch.Tensor | None = None  # (B, T, V); None when they come from a teacher cache as ``top_k``
    top_k: TopK | None = None


def run_target(target, batch: dict[str, torch.Tensor], needs: TargetNeeds) -> TargetOutputs:
    """One forward of the target over ``batch`` that yields what ``needs`` asks for."""
    if not needs.runs_target:
        return TargetOutputs()
    device = target.device
    taps = list(needs.layers) + ([target.num_layers] if needs.final_hidden else [])
    with HiddenStateTap(target.model, taps) as tap:
        out = target.model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device) if "attention_mask" in batch else None,
            use_cache=False,
            logits_to_keep=0 if needs.logits else 1,
        )
        captured = tap.get()
    return TargetOutputs(
        hidden=torch.cat(captured[: len(needs.layers)], dim=-1) if needs.layers else None,
        final=captured[-1] if needs.final_hidden else None,
        logits=out.logits if needs.logits else None,
    )


class _GivenHidden(nn.Module):
    """Stands in for the decoder stack: returns hidden states computed earlier."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def logits_from_final(target, final: torch.Tensor) -> torch.Tensor:
    """Next-token logits from the final hidden state, through the model's own forward after its decoder stack
    (lm_head, then whatever scaling or softcapping the architecture applies), not a re-implementation of it."""
    model = target.model
    prefix = model.base_model_prefix
    decoder = getattr(model, prefix)
    dummy_ids = torch.zeros(final.shape[:2], dtype=torch.long, device=final.device)
    setattr(model, prefix, _GivenHidden(final))
    try:
        return model(input_ids=dummy_ids, use_cache=False).logits
    finally:
        setattr(model, prefix, decoder)
