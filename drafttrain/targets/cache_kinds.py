"""Cache kinds: how each kind of layer a target's cache holds behaves while the target is decoded speculatively, one
table entry a kind. TargetCache (targets/cache.py) rolls each layer back, moves a tree's accepted path into place
and builds its tree mask by its kind; ``drafttrain plan`` counts what the cache holds by the same entries.

| kind | holds | a rollback | trees |
|---|---|---|---|
| full | keys and values of every position | drops positions (a tree's path moved into place) | yes |
| mla | one latent and one rotary key a position (transformers caches MLA compressed) | as full | yes |
| sliding | keys and values of the last ``window`` positions | as full, then trimmed to the window | yes, masked |
| chunked | keys and values of the current chunk | as sliding | yes, masked |
| recurrent | a state and a short convolution's inputs a sequence | takes the state recorded after the last kept token | no |
| conv | a short convolution's inputs | drops inputs | no |
| hybrid | a recurrent state beside full attention (Falcon-H1) | both | no |

A new kind of layer is one entry here (and what its layer type is called in transformers' ``layer_types``), plus its
row in the family matrix (tests/families.py)."""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from drafttrain import DrafttrainError
from drafttrain.targets.family import is_mla, text_config
from drafttrain.targets.hidden import decoder_layers


@dataclasses.dataclass(frozen=True)
class CacheKind:
    name: str
    positions: bool  # holds keys and values per position
    windowed: bool  # holds only the last positions of a window or chunk
    states: bool  # holds recurrent states and convolution inputs per sequence, whatever its length
    trees: bool  # one forward can verify a tree's branches through it (attention alone mixes the tokens)

    def position_bytes(self, config, itemsize: int, tensor: int = 1) -> int:
        """Bytes one held position costs in one layer of this kind, on one of ``tensor`` tensor-parallel ranks (whole
        key/value heads: with fewer heads than ranks each is replicated; an MLA latent is on every rank)."""
        if not self.positions:
            return 0
        text = text_config(config)
        if self.name == "mla":  # the latent and the shared rotary key
            return (text.kv_lora_rank + text.qk_rope_head_dim) * itemsize
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return 2 * math.ceil(heads / tensor) * head_dim * itemsize

    def sees(self, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor | bool:
        """Which key positions a query position attends to in a layer of this kind (beside causality): the last
        ``window`` positions (sliding), the query's own chunk of ``window`` (chunked), every one (the rest)."""
        if self.name == "sliding":
            return (queries - keys) < window
        if self.name == "chunked":
            return (queries // window) == (keys // window)
        return True

    def held_positions(self, tokens: int, window: int | None) -> int:
        """Positions one sequence of ``tokens`` leaves in the layer."""
        if not self.positions:
            return 0
        return min(tokens, window) if self.windowed and window else tokens


FULL = CacheKind("full", positions=True, windowed=False, states=False, trees=True)
MLA = CacheKind("mla", positions=True, windowed=False, states=False, trees=True)
SLIDING = CacheKind("sliding", positions=True, windowed=True, states=False, trees=True)
CHUNKED = CacheKind("chunked", positions=True, windowed=True, states=False, trees=True)
RECURRENT = CacheKind("recurrent", positions=False, windowed=False, states=True, trees=False)
CONV = CacheKind("conv", positions=False, windowed=False, states=True, trees=False)
HYBRID = CacheKind("hybrid", positions=True, windowed=False, states=True, trees=False)
NONE = CacheKind("none", positions=False, windowed=False, states=False, trees=True)  # a layer that caches nothing

# transformers' layer types (``layer_types``, or what get_layer_types_and_kwargs infers) -> their kind
LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED,
               "linear_attention": RECURRENT, "mamba": RECURRENT, "conv": CONV, "hybrid": HYBRID, "dummy": NONE}


def kind_of(layer_type: str, config) -> CacheKind:
    """The kind of a layer of ``layer_type`` in a model of ``config``; MLA is full attention over latents."""
    kind = LAYER_TYPES.get(layer_type)
    if kind is None:
        raise DrafttrainError(f"a target layer of type {layer_type!r}: drafttrain does not know how to roll its cache "
                              f"back (known: {', '.join(LAYER_TYPES)})")
    return MLA if kind is FULL and is_mla(config) else kind


def state_bytes(layer: torch.nn.Module, config, itemsize: int) -> int:
    """Bytes the recurrent state and convolution inputs of one decoder ``layer`` (a module) cost a sequence: its
    short convolutions' inputs (their kernel's width of each channel, read from the Conv1d modules it has) and its
    recurrent state (heads x key size x value size, named as each family's config names them)."""
    convs = [m for m in layer.modules() if isinstance(m, torch.nn.Conv1d)]
    conv = sum(m.in_channels * m.kernel_size[0] for m in convs)
    return (conv + recurrent_state_elements(config)) * itemsize


def recurrent_state_elements(config) -> int:
    """The elements of one layer's recurrent state, 0 for a layer without one (a short convolution alone)."""
    text = text_config(config)
    if getattr(text, "linear_num_value_heads", None):  # gated delta rule (Qwen3-Next, Qwen3.5)
        return text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    if getattr(text, "mamba_n_heads", None):  # Mamba-2 (Falcon-H1)
        ssm = getattr(text, "mamba_d_ssm", None) or int(text.mamba_expand * text.hidden_size)
        head = getattr(text, "mamba_d_head", None)
        head = head if isinstance(head, int) else ssm // text.mamba_n_heads
        return text.mamba_n_heads * head * text.mamba_d_state
    linear = getattr(text, "linear_attn_config", None)
    if linear:  # Kimi Delta Attention
        return linear["num_heads"] * linear["head_dim"] * linear["head_dim"]
    return 0


def cache_bytes(model: torch.nn.Module, tokens: int, itemsize: int, tensor: int = 1) -> list[tuple[str, int, int]]:
    """What one sequence of ``tokens`` leaves in ``model``'s cache, per decoder layer: (its kind's name, bytes of
    keys and values, bytes of recurrent states and convolution inputs), on one of ``tensor`` tensor-parallel ranks
    (states split evenly over them, as engines split a recurrent layer's heads).
    ``drafttrain plan`` counts caches by it; tests/test_cache_kinds.py holds it to what transformers' cache holds."""
    config = text_config(model.config)
    types, kwargs = get_layer_types_and_kwargs(config)
    layers, counted = decoder_layers(model), []
    for i, (layer_type, layer_kwargs) in enumerate(zip(types, kwargs)):
        kind = kind_of(layer_type, config)
        window = layer_kwargs.get("sliding_window")  # a window of w keeps the w - 1 positions before the next token
        positions = kind.held_positions(tokens, window - 1 if window else None) * kind.position_bytes(
            config, itemsize, tensor)
        states = math.ceil(state_bytes(layers[i], config, itemsize) / tensor) if kind.states else 0
        counted.append((kind.name, positions, states))
    return counted
