"""Hidden states of chosen target layers, taken from the unmodified HF model with forward hooks.

Layer indices follow HF's ``output_hidden_states`` convention, so they mean the same thing everywhere:
index i in [0, L) is the *input* of decoder layer i (0 = token embeddings), index L is the final, normed
output that feeds the lm_head (the decoder stack's output, whatever the family calls its last norm). Hooks keep only the requested tensors instead of all L+1.
"""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (what its lm_head reads the output of)."""
    if hasattr(model, "get_base_model"):  # peft's wrapper
        model = model.get_base_model()
    stack = model.get_decoder() if hasattr(model, "get_decoder") else None
    if stack is None or stack is model:  # Llama 4's causal LM names itself its decoder
        stack = getattr(model, getattr(model, "base_model_prefix", "model"), None) or model.model
    return stack


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layers: ``.layers`` where the family names them so, else its one list of
    ``num_hidden_layers`` modules."""
    stack = decoder(model)
    layers = getattr(stack, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    lists = [m for m in stack.children() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise DrafttrainError(f"{type(model).__name__}: cannot find its decoder layers (not a decoder-only HF model?)")
    return lists[0]


FINAL_NORM_NAMES = ("norm", "final_layernorm", "embedding_norm", "ln_f", "final_norm")


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's final norm, found by the names families give it."""
    stack = decoder(model)
    norm = next((getattr(stack, n) for n in FINAL_NORM_NAMES if isinstance(getattr(stack, n, None), torch.nn.Module)),
                None)
    if getattr(norm, "weight", None) is None:
        raise DrafttrainError(f"{type(model).__name__}: cannot find the decoder's final norm (looked for "
                              f"{', '.join(FINAL_NORM_NAMES)})")
    return norm


def final_norm_scale(model: torch.nn.Module) -> torch.Tensor:
    """The per-channel scale of the decoder's final RMS norm as it acts (Gemma's ``1 + weight`` included): what a
    draft's own Llama-style final norm starts from."""
    norm = final_norm(model)
    weight = norm.weight
    if getattr(norm, "bias", None) is not None or weight.is_meta or hasattr(weight, "ds_numel"):
        return weight.detach().clone()  # a LayerNorm's weight is its scale; on the meta device only shapes matter
    with torch.no_grad():  # an RMS norm of a vector whose RMS is 1 is its scale (over sqrt(1 + eps))
        scale = norm(torch.ones(1, weight.shape[-1], dtype=weight.dtype, device=weight.device))[0].detach()
    # a plain ``weight`` scale is taken exactly, not through the epsilon
    return weight.detach().clone() if torch.allclose(scale, weight, rtol=1e-4, atol=1e-6) else scale


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
        def hook(module, args, output):  # the decoder's output: its final (normed) hidden state
            self.captured[index] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        return hook

    def __enter__(self) -> "HiddenStateTap":
        layers = decoder_layers(self.model)
        for index in set(self.layers):
            if index == len(layers):
                handle = decoder(self.model).register_forward_hook(self._post_hook(index))
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
