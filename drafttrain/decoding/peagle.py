"""The ``eagle`` proposer for P-EAGLE heads (drafttrain.drafts.peagle): the last real pair drafts token 1, and k - 1
mask slots after it draft tokens 2..k, all in one head forward."""

from __future__ import annotations

import torch

from drafttrain.decoding.eagle import EagleProposer
from drafttrain.decoding.positional import MaskSlotDrafting
from drafttrain.decoding.proposers import register_proposer_variant
from drafttrain.drafts.peagle import PEagleDrafter
from drafttrain.targets import Target


@register_proposer_variant("eagle", serves=PEagleDrafter)
class PEagleProposer(MaskSlotDrafting, EagleProposer):
    def __init__(self, target: Target, *, draft=None):
        super().__init__(target, draft=draft)
        self.max_depth = type(self.head).max_draft_depth(self.head.config)

    def _first_logits(self) -> torch.Tensor:
        return self.root_logits  # the last real pair's, computed when it was accepted

    def _mask_slot_logits(self, slots: int) -> torch.Tensor:
        hidden = self.head.mask_hidden_fused().expand(1, slots, -1)
        tokens = torch.full((1, slots), self.head.mask_token_id, dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + slots, device=self.device).unsqueeze(0)
        return self.head.step(hidden, tokens, positions, self.caches)[1][0]
