"""The target layers a head reads (its taps) as serving engines collect them: i is the input of decoder layer i, the
final output is never one. Shared by every kind that fuses a low, a middle and a high layer."""

from __future__ import annotations

from drafttrain import DrafttrainError


def low_mid_high_taps(num_layers: int) -> list[int]:
    """The low/mid/high taps: the inputs of layers 2, L/2 and L-3 (vLLM's and SpecForge's default), each once (a
    shallow target can map two of them to one layer)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def check_taps(layers: list[int], num_layers: int) -> list[int]:
    """The taps as vLLM and SGLang read them: ascending, unique, each the input of a real layer (< L)."""
    if layers != sorted(set(layers)) or any(not 0 <= i < num_layers for i in layers):
        raise DrafttrainError(
            f"aux layer ids {layers} must be ascending, unique and in 0..{num_layers - 1} for this "
            f"{num_layers}-layer target (i = the input of layer i; the final output is not a tap): serving engines "
            "collect the taps in layer order and never the final output"
        )
    return list(layers)
