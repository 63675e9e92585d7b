"""The ``draft_model`` proposer for PARD drafts (drafttrain.drafts.pard): the root's logits give draft token 1, and
k - 1 mask tokens after it, in one causal forward of the draft model, give tokens 2..k."""

from __future__ import annotations

import torch

from drafttrain.decoding.draft_model import DraftModelProposer
from drafttrain.decoding.positional import MaskSlotDrafting
from drafttrain.decoding.proposers import register_proposer_variant, trained_draft
from drafttrain.drafts.pard import PardDrafter
from drafttrain.targets import Target


@register_proposer_variant("draft_model", serves=PardDrafter)
class PardProposer(MaskSlotDrafting, DraftModelProposer):
    def __init__(self, target: Target, *, draft=None, vocab=None):
        super().__init__(target, draft=draft, vocab=vocab)
        pard = trained_draft(self.name, target, draft)  # the draft itself when given one (build_proposer does)
        self.mask_token_id, self.max_depth = pard.mask_token_id, type(pard).max_draft_depth(pard.config)

    def _first_logits(self) -> torch.Tensor:
        return self._root_logits()  # feeds the accepted tokens and the root

    def _mask_slot_logits(self, slots: int) -> torch.Tensor:
        masks = torch.full((1, slots), self.mask_token_id, dtype=torch.long, device=self.device)
        return self._aligned(self.cache.forward(masks, head=self.head)[0])
