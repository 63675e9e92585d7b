"""Attention masks handed to an unmodified HF model: the one rule for a 4D mask transformers passes through."""

from __future__ import annotations

import functools
import inspect

import torch

from drafttrain.targets.hidden import decoder


def additive_mask(allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A 4D float mask [1, 1, q, prefix_len + k] from ``allowed`` [q, k]: every query sees the whole cached
    prefix, and of the k new keys only those allowed. Float (0 / dtype-min) works for both sdpa and eager
    attention; transformers passes a 4D mask through untouched (masking_utils._preprocess_mask_arguments)."""
    q, k = allowed.shape
    mask = torch.zeros(q, prefix_len + k, dtype=dtype, device=device)
    mask[:, prefix_len:].masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]


def model_forward(model: torch.nn.Module, cache, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  attention_mask, logits_to_keep: int = 0, head: torch.nn.Linear | None = None) -> torch.Tensor:
    """The model's own forward over ``input_ids`` with ``cache`` (appended to): logits [B, n or logits_to_keep, V].
    ``head`` (H -> V'): logits over these output rows only (a draft vocabulary), from the decoder's last hidden
    state, instead of the model's own full-vocabulary lm_head."""
    inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True)
    if head is None:
        return model(**inputs, **{cache_argument(type(model)): cache}, logits_to_keep=logits_to_keep).logits
    stack = decoder(model)
    hidden = stack(**inputs, **{cache_argument(type(stack)): cache}).last_hidden_state
    return head(hidden[:, -logits_to_keep:])  # 0 keeps all, as in HF


@functools.cache
def cache_argument(model_class: type) -> str:
    """The name under which ``model_class.forward`` takes its KV cache. transformers renamed ``past_key_values``
    to ``cache`` (5.24 warns; the old name goes in 5.40) and drafttrain supports 5.0 on, so it asks the model."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
