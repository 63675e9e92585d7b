"""One interface for where a draft's target outputs come from, whatever computes them.

A :class:`TargetSource` gives two things: ``outputs(batch)``, the :class:`TargetOutputs` a training step (or a
held-out evaluation) needs for a batch of rows, and ``states(rows)``, per row the entries an offline cache keeps
(``layer{n}``: the hidden state at HF index n, n = num_layers the final, normed one; ``argmax``; a teacher's
``topk_*``; ``prenorm``, the final state before the final norm, from a source made with ``prenorm=True``), which
the cache writer stores. ``ask(rows)`` tells a source which rows will be asked for next, in order,
so one that computes them elsewhere (an engine) can have them ready; ``stats()`` is what it reports of itself.

The implementations: the HF forward in this process (sources/hf.py), the offline cache on disk (sources/cache.py)
and a serving engine's capture (sources/engine.py). Which one runs is chosen once (sources/choose.py); nothing that
takes outputs from a source asks which it is.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

import torch

from drafttrain.targets import Target
from drafttrain.targets.hidden import final_norm
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, TopK, full_argmax, target_logits

ROW_INDEX = "row_index"  # batch key: the dataset row of each batch row (sources that work by row read it)
# entry: the final state before the final norm, as vLLM captures it and speculators' files keep it
PRENORM = "prenorm"


class TargetSource(abc.ABC):
    """Where the target outputs of rows come from (see the module docstring)."""

    name: str

    def __init__(self, target: Target, needs: TargetNeeds, prenorm: bool = False):
        self.target, self.needs, self.prenorm = target, needs, prenorm

    @abc.abstractmethod
    def outputs(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        """The outputs for a right-padded batch (``input_ids``, ``attention_mask``, ``row_index``)."""

    def states(self, rows: list[int]) -> list[dict[str, torch.Tensor]]:
        """Per row, what an offline cache keeps of it (unpadded, on the CPU)."""
        raise NotImplementedError(f"the {self.name} source does not write an offline cache")

    def ask(self, rows: Iterable[int]) -> None:
        """The rows that will be asked for next, in order (the default source computes each when asked)."""

    def stats(self) -> dict[str, float]:
        """What the source reports of itself for the training log (each process's own; the log averages them)."""
        return {}

    def lagging(self) -> str | None:
        """A line when training waits for this source (None: it keeps up)."""
        return None

    def close(self) -> None:
        pass

    def __call__(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        return self.outputs(batch)


def normed_final(target: Target, prenorm: torch.Tensor) -> torch.Tensor:
    """The final state the target's head reads, from the state before its final norm: the target's own norm applied
    (in the target's dtype, on the CPU)."""
    norm = final_norm(target.model)
    with torch.no_grad():
        return norm(prenorm.to(device=norm.weight.device, dtype=target.model.dtype)).cpu()


def states_of_slots(hidden: torch.Tensor, layer_ids: list[int], target: Target) -> dict[str, torch.Tensor]:
    """A row's entries from states captured in vLLM's layer ids (``hidden [T, len(layer_ids), H]``, an engine's file
    or speculators'): id n is HF index n, except that id num_layers is the final state *before* the norm
    (``prenorm``), and its ``layer{num_layers}`` the normed one."""
    entries = {f"layer{layer}": hidden[:, i] for i, layer in enumerate(layer_ids)}
    final = f"layer{target.num_layers}"
    if final in entries:
        entries[PRENORM] = entries[final]
        entries[final] = normed_final(target, entries[PRENORM])
    return entries


def argmax_entry(target: Target, final: torch.Tensor) -> torch.Tensor:
    """The ``argmax`` entry of a row (T, 1) from its final, normed state (T, H): the target's argmax over its whole
    vocabulary, chunk by chunk."""
    return full_argmax(target, final[None].to(target.device))[0, :, None].to(torch.int32).cpu()


def cached_names(needs: TargetNeeds, num_layers: int, argmax: bool) -> list[str]:
    """The entries a row's outputs are assembled from: its stored layers, a teacher's top-k, the argmax."""
    names = [f"layer{layer}" for layer in needs.stored_layers(num_layers)]
    if needs.logits and needs.logits_top_k is not None:
        names += ["topk_ids", "topk_log_probs", "topk_rest"]
    return names + (["argmax"] if argmax else [])


def assemble(per_row: list[dict[str, torch.Tensor]], seq_len: int, target: Target, needs: TargetNeeds,
             rows_weight: torch.Tensor | None = None) -> TargetOutputs:
    """Right-padded :class:`TargetOutputs` from each row's entries, in the target's dtype on its device. With
    ``rows_weight`` (a draft vocabulary's lm_head rows) and each row's ``argmax``, only those rows of the logits are
    computed; otherwise the logits come from the final state through the target's own head."""
    dtype, final_name = target.model.dtype, f"layer{target.num_layers}"

    def padded(name: str, out_dtype=dtype) -> torch.Tensor:
        width = per_row[0][name].shape[-1]
        out = torch.zeros(len(per_row), seq_len, width, dtype=out_dtype)
        for i, tensors in enumerate(per_row):
            x = tensors[name][:seq_len]
            out[i, : x.shape[0]] = x.to(out_dtype)
        return out.to(target.device)

    final = padded(final_name) if final_name in per_row[0] else None
    top_k = needs.logits_top_k if needs.logits else None
    kept = TopK(ids=padded("topk_ids", torch.long), log_probs=padded("topk_log_probs", torch.float32),
                rest=padded("topk_rest", torch.float32)) if top_k else None
    if rows_weight is not None:
        logits, argmax = final @ rows_weight.to(final.dtype).T, padded("argmax", torch.long)[..., 0]
    elif needs.logits and not top_k:
        logits, argmax = target_logits(target, final, needs.logits_rows)
    else:
        logits, argmax = None, None
    return TargetOutputs(
        hidden=torch.cat([padded(f"layer{layer}") for layer in needs.layers], dim=-1) if needs.layers else None,
        final=final if needs.final_hidden else None,
        logits=logits,
        top_k=kept,
        argmax=argmax,
    )


def mean_stats(per_process: list[dict[str, float]]) -> dict[str, float]:
    """The processes' source statistics, averaged key by key (rounded for the log)."""
    keys = dict.fromkeys(k for stats in per_process for k in stats)
    return {k: round(sum(s.get(k, 0.0) for s in per_process) / len(per_process), 4) for k in keys}
