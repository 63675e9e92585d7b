"""Cache kinds (targets/cache_kinds.py) name what each layer of a target's cache holds, and how many bytes: for every
family of both matrices (hand-written and published configs), the table's bytes per position and per sequence are
what transformers' cache really holds after a prompt, layer by layer."""

from __future__ import annotations

import pytest
import torch
from families import CACHE_KIND, PUBLISHED_CACHE_KIND, family_model, published_model
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from drafttrain.targets.cache_kinds import cache_bytes, kind_of
from drafttrain.targets.family import text_config

TOKENS = 24  # past every window of the matrices (8)


def held_bytes(layer) -> tuple[int, int]:
    """(bytes of keys and values, bytes of convolution inputs and recurrent states) a cache layer holds."""
    positions = sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor))
    states = sum(t.numel() * t.element_size() for name in ("conv_states", "recurrent_states")
                 for t in (getattr(layer, name, None) or {}).values() if isinstance(t, torch.Tensor))
    return positions, states


def counted_and_held(model) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """Per layer: what cache_bytes counts for a prompt of TOKENS, and what transformers' own cache (as plain decoding
    keeps it) holds after it."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(1, TOKENS + 1)[None], past_key_values=cache, use_cache=True)
    counted = cache_bytes(model, TOKENS, next(model.parameters()).element_size())
    assert len(counted) == len(cache.layers)
    return [(f"{i}:{kind}", (positions, states), held_bytes(held))
            for i, ((kind, positions, states), held) in enumerate(zip(counted, cache.layers))]


@pytest.mark.parametrize("family", list(CACHE_KIND))
def test_the_table_counts_what_a_hand_written_familys_cache_holds(family):
    for layer, counted, held in counted_and_held(family_model(family)):
        assert counted == held, (family, layer)


@pytest.mark.parametrize("name", list(PUBLISHED_CACHE_KIND))
def test_the_table_counts_what_a_published_configs_cache_holds(name):
    for layer, counted, held in counted_and_held(published_model(name)):
        assert counted == held, (name, layer)


def test_the_kinds_name_the_matrix_cache_kinds():
    """The matrix's words for its families' caches are the table's kinds (its "sliding" covers chunked windows, its
    "recurrent" a hybrid's states)."""
    for family, word in CACHE_KIND.items():
        model = family_model(family)
        config = text_config(model.config)
        kinds = {kind_of(t, config).name for t in get_layer_types_and_kwargs(config)[0]}
        words = {"chunked": "sliding", "hybrid": "recurrent"}
        assert word in kinds | {words.get(kind, kind) for kind in kinds}, (family, kinds)
