"""Frozen target models: loading (Hub id, folder, GGUF, built-in names) and hidden-state capture."""

from drafttrain.targets.hidden import HiddenStateTap, eagle3_default_layers, resolve_layers
from drafttrain.targets.loading import BUILTIN_TARGETS, Target, load_target, load_tokenizer

__all__ = [
    "BUILTIN_TARGETS",
    "HiddenStateTap",
    "Target",
    "eagle3_default_layers",
    "load_target",
    "load_tokenizer",
    "resolve_layers",
]
