"""What a draft learns from: the target outputs a draft kind declares it needs, computed in one target forward.

A kind declares its needs as :class:`TargetNeeds`: hidden states at named layers (taps), the final hidden state
(the lm_head's input), the next-token logits, or nothing at all (a draft model that brings its own data
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
from transformers.modeling_outputs import BaseModelOutputWithPast

from drafttrain import DrafttrainError
from drafttrain.targets.hidden import HiddenStateTap
from drafttrain.targets.hidden import decoder as decoder_of
from drafttrain.targets.loading import Target


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
    # Only these vocabulary entries' logits (a draft vocabulary's target ids), with the full-vocabulary argmax
    # beside them: [B, T, V] never exists at once (see target_logits). None: the full vocabulary.
    logits_rows: torch.Tensor | None = dataclasses.field(default=None, compare=False)

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
    logits: torch.Tensor | None = None  # (B, T, V) or (B, T, rows); None when they come from a teacher cache
    top_k: TopK | None = None
    argmax: torch.Tensor | None = None  # (B, T): the full-vocabulary argmax, when ``logits`` holds only some rows


# Sequence positions per logits chunk: the full-vocabulary logits of batch x chunk positions exist at once (at
# Llama-3's 128k vocabulary, 4 rows x 512 positions is 1 GB in fp32 instead of 4 GB per 2048-token row).
LOGITS_CHUNK = 512


def run_target(target: Target, batch: dict[str, torch.Tensor], needs: TargetNeeds, chunk: int = LOGITS_CHUNK) -> TargetOutputs:
    """One forward of the target over ``batch`` that yields what ``needs`` asks for. The logits are computed from
    the final hidden state afterwards, ``chunk`` positions at a time (see :func:`target_logits`)."""
    if not needs.runs_target:
        return TargetOutputs()
    device = target.device
    taps = list(needs.layers) + ([target.num_layers] if needs.final_hidden or needs.logits else [])
    with HiddenStateTap(target.model, taps) as tap:
        target.model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device) if "attention_mask" in batch else None,
            use_cache=False,
            logits_to_keep=1,  # the lm_head runs in target_logits, chunk by chunk
        )
        captured = tap.get()
    final = captured[-1] if needs.final_hidden or needs.logits else None
    logits, argmax = target_logits(target, final, needs.logits_rows, chunk) if needs.logits else (None, None)
    return TargetOutputs(
        hidden=torch.cat(captured[: len(needs.layers)], dim=-1) if needs.layers else None,
        final=final if needs.final_hidden else None,
        logits=logits,
        argmax=argmax,
    )


def target_logits(target: Target, final: torch.Tensor, rows: torch.Tensor | None = None,
                  chunk: int = LOGITS_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits from its final hidden state, ``chunk`` sequence positions at a time. With ``rows``
    (vocabulary ids), only those entries are kept, and the full-vocabulary argmax is returned beside them; only
    one chunk's full logits ever exist. Returns (logits, argmax or None)."""
    if rows is None and final.shape[1] <= chunk:
        return logits_from_final(target, final), None
    kept, argmax = [], []
    for start in range(0, final.shape[1], chunk):
        full = logits_from_final(target, final[:, start: start + chunk])
        if rows is None:
            kept.append(full)
            continue
        with torch.no_grad():
            argmax.append(full.argmax(-1))
        kept.append(full.index_select(-1, rows.to(full.device)))
        del full
    return torch.cat(kept, dim=1), torch.cat(argmax, dim=1) if rows is not None else None


def full_argmax(target: Target, final: torch.Tensor, chunk: int = LOGITS_CHUNK) -> torch.Tensor:
    """The target's argmax over its whole vocabulary, ``chunk`` positions at a time (one chunk's logits exist)."""
    return torch.cat([logits_from_final(target, final[:, start: start + chunk]).argmax(-1)
                      for start in range(0, final.shape[1], chunk)], dim=1)


def rows_and_argmax(outputs: TargetOutputs, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-vocabulary argmax, logits at ``rows``) from outputs that hold either all logits or just those rows."""
    if outputs.argmax is not None:
        return outputs.argmax, outputs.logits
    return outputs.logits.argmax(-1), outputs.logits.index_select(-1, rows)


class _DecoderOutput(BaseModelOutputWithPast):
    """The decoder's output as every causal LM head reads it: what an MoE head asks of it besides the hidden state
    (``router_logits`` for its auxiliary loss) is absent, as when the router's outputs are not requested."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _GivenHidden(nn.Module):
    """Stands in for the decoder stack: returns hidden states computed earlier. What the head reads of the decoder
    besides its output (Falcon-H1's ``lm_head_multiplier``) is the real decoder's."""

    def __init__(self, hidden: torch.Tensor, decoder: nn.Module):
        super().__init__()
        self.hidden = hidden
        object.__setattr__(self, "_decoder", decoder)  # not a submodule: nothing of it is registered twice

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_decoder"), name)

    def forward(self, *args, **kwargs):
        return _DecoderOutput(last_hidden_state=self.hidden)


def plain_lm_head(model: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The model's lm_head when its logits are ``hidden @ weight.T`` and nothing else, so that some rows of them can
    be computed alone (a draft vocabulary); a clear error otherwise, or when ``rows`` name a row it does not have."""
    config, lm_head = model.config, model.get_output_embeddings()
    scaled = [k for k in ("final_logit_softcapping", "logit_scale") if getattr(config, k, None)]
    if scaled or getattr(lm_head, "bias", None) is not None:
        raise DrafttrainError(f"a draft vocabulary needs a plain linear lm_head; this draft's has "
                              f"{', '.join(scaled) or 'a bias'} (use the whole vocabulary)")
    if int(rows.max()) >= lm_head.weight.shape[0]:
        raise DrafttrainError(f"the draft vocabulary names token {int(rows.max())}, the draft's lm_head has "
                              f"{lm_head.weight.shape[0]} rows")
    return lm_head


def plain_rows(model: nn.Module, rows: torch.Tensor) -> torch.Tensor | None:
    """The lm_head's weight rows ``rows`` when the logits are ``hidden @ weight.T`` and nothing else; None for a head
    that scales, softcaps or has a bias, or whose weight ZeRO-3 has partitioned (only the model's own forward
    gathers it): those rows' logits are then taken from the full ones."""
    try:
        weight = plain_lm_head(model, rows).weight.detach()
    except DrafttrainError:
        return None
    if hasattr(weight, "ds_numel") or weight.numel() == 0:
        return None
    return weight[rows.to(weight.device)]


def logits_from_final(target: Target, final: torch.Tensor) -> torch.Tensor:
    """Next-token logits from the target's final hidden state (:func:`head_logits`)."""
    return head_logits(target.model, final)


def head_logits(model: nn.Module, final: torch.Tensor) -> torch.Tensor:
    """Next-token logits from a causal LM's final hidden state [B, T, H], through the model's own forward after its
    decoder stack (lm_head, then whatever scaling or softcapping the architecture applies), not a re-implementation
    of it: how logits are computed for some positions alone."""
    if hasattr(model, "get_base_model"):  # peft's wrapper (Medusa-2's adapters): its attributes are not the model's
        model = model.get_base_model()
    decoder = decoder_of(model)
    prefix = next(name for name, child in model.named_children() if child is decoder)
    dummy_ids = torch.zeros(final.shape[:2], dtype=torch.long, device=final.device)
    setattr(model, prefix, _GivenHidden(final, decoder))
    try:
        return model(input_ids=dummy_ids, use_cache=False).logits
    finally:
        setattr(model, prefix, decoder)
