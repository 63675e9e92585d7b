"""Targets: loading (Hub id, folder, GGUF, built-in names), hidden-state taps, and the outputs drafts learn from."""

from drafttrain.targets.cache import TargetCache
from drafttrain.targets.hidden import HiddenStateTap, resolve_layers
from drafttrain.targets.loading import (
                                       BUILTIN_TARGETS,
                                       Target,
                                       check_same_tokenizer,
                                       load_target,
                                       load_tokenizer,
                                       synchronize,
)
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, logits_from_final, run_target

__all__ = [
    "BUILTIN_TARGETS",
    "HiddenStateTap",
    "Target",
    "TargetCache",
    "TargetNeeds",
    "TargetOutputs",
    "check_same_tokenizer",
    "load_target",
    "load_tokenizer",
    "logits_from_final",
    "resolve_layers",
    "run_target",
    "synchronize",
]
