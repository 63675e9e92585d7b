"""The target's own HF forward in this process: the default source (every CPU run, and CI). Online, the target runs
inside every training step; for the offline cache, once per row of the train split."""

from __future__ import annotations

import torch

from drafttrain.sources.base import PRENORM, TargetSource, argmax_entry
from drafttrain.targets import Target
from drafttrain.targets.hidden import HiddenStateTap, final_norm
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, run_target, top_k_of


class _NormInput:
    """The input of the target's final norm during a forward (when ``wanted``): the final state before the norm."""

    def __init__(self, model: torch.nn.Module, wanted: bool):
        self.model, self.wanted, self.captured, self._handle = model, wanted, None, None

    def __enter__(self) -> "_NormInput":
        if self.wanted:
            def keep(module, args, kwargs):
                self.captured = args[0] if args else kwargs["hidden_states"]
            self._handle = final_norm(self.model).register_forward_pre_hook(keep, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()


class HFForward(TargetSource):
    """The target's forward, hooked at the layers a kind needs (``dataset``: the rows ``states`` reads)."""

    name = "hf"

    def __init__(self, target: Target, needs: TargetNeeds, dataset=None, cache_argmax: bool = False,
                 prenorm: bool = False):
        super().__init__(target, needs, prenorm)
        self.dataset, self.cache_argmax = dataset, cache_argmax

    def outputs(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        return run_target(self.target, batch, self.needs)

    @torch.no_grad()
    def states(self, rows: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self._row(int(row)) for row in rows]

    def _row(self, row: int) -> dict[str, torch.Tensor]:
        target, needs = self.target, self.needs
        layers = needs.stored_layers(target.num_layers)
        top_k = needs.logits_top_k if needs.logits else None
        ids = torch.tensor(self.dataset[row]["input_ids"]).unsqueeze(0)
        with HiddenStateTap(target.model, layers) as tap, _NormInput(target.model, self.prenorm) as prenorm:
            logits = target.model(input_ids=ids.to(target.device), use_cache=False,
                                  logits_to_keep=0 if top_k else 1).logits
            captured = tap.get()
        entries = {f"layer{layer}": hidden[0] for layer, hidden in zip(layers, captured)}
        if self.prenorm:
            entries[PRENORM] = prenorm.captured[0]
        if self.cache_argmax:  # from the final hidden state (the last layer kept), chunk by chunk
            entries["argmax"] = argmax_entry(target, captured[-1][0])
        if top_k:  # the teacher's distribution as its top-k (float32 log-probabilities: k values per token)
            kept = top_k_of(logits[0], top_k, needs.logits_temperature)
            entries.update(topk_ids=kept.ids.to(torch.int32).cpu(), topk_log_probs=kept.log_probs.cpu(),
                           topk_rest=kept.rest.cpu())
        return entries
