"""Hidden states of chosen target layers, taken from the unmodified HF model with forward hooks.

Layer indices follow HF's ``output_hidden_states`` convention, so they mean the same thing everywhere:
index i in [0, L) is the *input* of decoder layer i (0 = token embeddings), index L is the final, normed
output that feeds the lm_head. Hooks keep only the requested tensors instead of all L+1.
"""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError


def _decoder_part(model: torch.nn.Module, name: str) -> torch.nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    part = getattr(base, name, None)
    if part is None:
        raise DrafttrainError(f"{type(model).__name__}: cannot find .model.{name} (not a decoder-only HF model?)")
    return part


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return _decoder_part(model, "layers")


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    return _decoder_part(model, "norm")


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """Check tap indices against the target; negative indices count from the final output (-1 = L)."""
    out = []
    for idx in layers:
        real = idx + num_layers + 1 if idx < 0 else idx
        if not 0 <= real <= num_layers:
            raise DrafttrainError(
                f"hidden-state layer {idx} does not exist: the target has {num_layers} layers "
                f"(valid indices 0..{num_layers}, or -1 for the final output)"
            )
        out.append(real)
    return out


class HiddenStateTap:
    """Context manager that records the hidden states of ``layers`` during any forward of ``model``.

    >>> with HiddenStateTap(model, [2, 15, 27]) as tap:
    ...     logits = model(input_ids).logits
    >>> tap.stacked().shape  # (batch, seq, 3 * hidden)
    """

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        self.model = model
        self.layers = resolve_layers(list(layers), model.config.num_hidden_layers)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[index] = hidden

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self.captured[index] = output

        return hook

    def __enter__(self) -> "HiddenStateTap":
        layers = decoder_layers(self.model)
        for index in set(self.layers):
            if index == len(layers):
                handle = final_norm(self.model).register_forward_hook(self._post_hook(index))
            else:
                handle = layers[index].register_forward_pre_hook(self._pre_hook(index), with_kwargs=True)
            self._handles.append(handle)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def get(self) -> list[torch.Tensor]:
        missing = [i for i in self.layers if i not in self.captured]
        if missing:
            raise RuntimeError(f"no hidden state was captured for layers {missing}: did the forward run?")
        return [self.captured[i] for i in self.layers]

    def stacked(self) -> torch.Tensor:
        """The taps concatenated on the feature axis, in the order requested."""
        return torch.cat(self.get(), dim=-1)

    def clear(self) -> None:
        self.captured.clear()
