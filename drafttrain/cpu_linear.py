"""Linear layers with pre-packed weights for decoding on a CPU.

PyTorch runs ``nn.Linear`` on a CPU through MKL's sgemm, whose kernels for 2–8 rows are poor on some processors:
on the AMD EPYC machines this project runs on, a 576 → 1536 linear costs 71 µs for 1 row and 165–200 µs for 2–4,
and SmolLM2's 576 → 49,152 lm_head 10 ms for 1 row and 18–35 ms for 2–4 (BENCHMARKS.md, "Packed linear layers").
A verification forward of a few tokens is exactly that shape, so speculative decoding paid about 1.6–1.9 plain
steps per cycle before drafting anything. oneDNN with the weight reordered once into its blocked layout (the
kernels PyTorch's own inductor uses when it freezes a CPU model) is nearly flat from 1 to 8 rows, and faster at 1.

``PackedLinears(*modules)`` is a context manager: inside it every eligible ``nn.Linear`` of the modules runs
through the packed weight, and on exit the modules are as they were (the HF classes and their weights are never
changed; only an instance ``forward`` is set and removed). A layer falls back to its own forward whenever autograd
needs it or its weight changed since it was packed, so a draft that trains between evaluations is never served
stale weights. Plain decoding and speculative decoding in one evaluation run through the same kernels, so their
ratio stays a like-for-like measurement.

oneDNN's packed kernel computes each row independently of the others (bit-identical outputs for 1 row or 16; MKL's
are not), so a verification forward's logits for a position equal a plain step's more often than before.
"""

from __future__ import annotations

import functools
import os

import torch

from drafttrain import DrafttrainError

ENV_VAR = "DRAFTTRAIN_CPU_LINEAR"  # "packed" (default) or "default": PyTorch's own kernel, for comparisons
MODES = ("packed", "default")


def cpu_linear_mode(requested: str | None = None) -> str:
    """The kernel choice: the argument, else $DRAFTTRAIN_CPU_LINEAR, else "packed"."""
    mode = requested or os.environ.get(ENV_VAR) or "packed"
    if mode not in MODES:
        raise DrafttrainError(f"cpu linear kernel {mode!r}: expected one of {', '.join(MODES)} (from {ENV_VAR} or the "
                         "command line)")
    return mode


def packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def _bf16_packing() -> bool:
    """oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere the reorder
    raises, so a bf16 target on an AVX2 CPU keeps PyTorch's own kernel."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(layer: torch.nn.Linear, devices: tuple[str, ...] = ("cpu",)) -> bool:
    weight = layer.weight
    # a subclass with a forward of its own computes something else (Llama 4's router returns scores and logits)
    return (type(layer).forward is torch.nn.Linear.forward and weight.device.type in devices and weight.layout == torch.strided and weight.dim() == 2
            and weight.numel() > 0  # a ZeRO-3 partitioned weight is an empty placeholder
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _bf16_packing()))
            and (layer.bias is None or layer.bias.dtype == weight.dtype))


def packed_weight_bytes(model: torch.nn.Module, mode: str | None = None) -> int:
    """The memory ``PackedLinears(model)`` adds while it is active: a oneDNN copy of each eligible layer's weight,
    as large as the weight (measured on SmolLM2-135M: 494 MiB more resident memory for its 513 MiB of linear weights,
    lm_head's copy included though its weight is tied to the embedding). A model on the meta device counts as on a
    CPU, so the planner can ask before anything is loaded."""
    if cpu_linear_mode(mode) != "packed" or not packing_available():
        return 0
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in model.modules()
               if isinstance(layer, torch.nn.Linear) and _packable(layer, devices=("cpu", "meta")))


def _packed_forward(layer: torch.nn.Linear, packed: torch.Tensor, version: int, x: torch.Tensor) -> torch.Tensor:
    weight = layer.weight
    if (weight._version != version or x.dtype != weight.dtype or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        return torch.nn.functional.linear(x, weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


class PackedLinears:
    """A context manager: inside it every eligible CPU ``nn.Linear`` of the modules given (to the constructor or
    later to ``add``, e.g. a draft loaded after the target) runs through a pre-packed oneDNN weight; on exit every
    one is restored. ``count``: the layers packed (0 when the mode is "default", nothing is on a CPU, or this
    PyTorch has no oneDNN)."""

    def __init__(self, *modules: torch.nn.Module | None, mode: str | None = None):
        self.mode = cpu_linear_mode(mode)
        self.enabled = self.mode == "packed" and packing_available()
        self._modules = modules
        self._patched: list[torch.nn.Linear] = []
        self._active = False

    @property
    def count(self) -> int:
        return len(self._patched)

    def add(self, *modules: torch.nn.Module | None) -> None:
        if not (self.enabled and self._active):
            return
        for module in modules:
            for layer in (module.modules() if isinstance(module, torch.nn.Module) else ()):
                # a forward already set on the instance: packed by an outer block, or an accelerate hook's
                if isinstance(layer, torch.nn.Linear) and "forward" not in vars(layer) and _packable(layer):
                    with torch.no_grad():
                        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
                    layer.forward = functools.partial(_packed_forward, layer, packed, layer.weight._version)
                    self._patched.append(layer)

    def __enter__(self) -> "PackedLinears":
        self._active = True
        try:
            self.add(*self._modules)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for layer in self._patched:
            del layer.forward
        self._patched.clear()
        self._active = False
