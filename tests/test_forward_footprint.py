"""The plan's count of a target's forward (training/footprint.py: target_forward_bytes, the model's own forward run
on the meta device) against the bytes the same forward really holds at its peak on this CPU, for every published
config of the family matrix: experts (grouped or over every expert), eager attention's scores, MLA, recurrent and
convolution layers. The count it replaced, one formula of the hidden and MLP widths, was 2-5x low for experts and
missed eager attention's quadratic scores (docs/studies/scale_out.md)."""

from __future__ import annotations

import weakref

import pytest
import torch
from families import PUBLISHED_CACHE_KIND, published_model
from torch.utils._python_dispatch import TorchDispatchMode

from drafttrain.targets import Target
from drafttrain.training.footprint import target_forward_bytes

ROWS, LENGTH = 2, 256


class PeakOfTensors(TorchDispatchMode):
    """The most bytes of tensors alive at once while the mode is on, the model's own parameters and buffers
    left out: each new storage counts until its last reference goes."""
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.alive = {t.untyped_storage().data_ptr(): 0 for t in (*model.parameters(), *model.buffers())}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.alive:
                storage = t.untyped_storage()
                self.alive[storage.data_ptr()] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._release, storage.data_ptr())
        return out

    def _release(self, key: int) -> None:
        self.now -= self.alive.pop(key, 0)


def real_peak(model: torch.nn.Module) -> int:
    """The forward as regeneration's prefill runs it: a padded batch (the first row one token shorter), no cache,
    the last position's logits."""
    ids = torch.randint(1, 1000, (ROWS, LENGTH))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with torch.no_grad(), PeakOfTensors(model) as peak:
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    return peak.peak


def counted(model: torch.nn.Module) -> int:
    config = model.config
    with torch.device("meta"):
        meta = type(model)(config).eval()
    return target_forward_bytes(Target("meta", meta, tokenizer=None), ROWS * LENGTH, LENGTH)


@pytest.mark.parametrize("name", list(PUBLISHED_CACHE_KIND))
def test_the_plan_counts_what_a_published_targets_forward_holds(name):
    model = published_model(name)
    held, planned = real_peak(model), counted(model)
    # measured 1.00-1.08, LFM2 1.32 (its convolution's padded copies on the meta device)
    assert 0.98 * held <= planned <= 1.35 * held, (name, held, planned)
