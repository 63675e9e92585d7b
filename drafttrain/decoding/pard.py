"""The ``draft_model`` proposer for PARD drafts (drafttrain.drafts.pard): the root's logits give draft token 1, and
k - 1 mask tokens after it, in one causal forward of the draft model, give tokens 2..k."""

from __future__ import annotations

import torch

from drafttrain.decoding.draft_model import DraftModelProposer
from drafttrain.decoding.positional import positional_draft
from drafttrain.decoding.proposers import DraftRequest, register_proposer_variant, trained_draft
from drafttrain.decoding.trees import Chain, Draft, StaticTree
from drafttrain.drafts.pard import PardDrafter
from drafttrain.targets import Target


@register_proposer_variant("draft_model", serves=PardDrafter)
class PardProposer(DraftModelProposer):
    shapes = (Chain, StaticTree)  # every position's distribution from one forward: no tree that grows by level

    def __init__(self, target: Target, *, draft=None, vocab=None):
        super().__init__(target, draft=draft, vocab=vocab)
        pard = trained_draft(self.name, target, draft)  # the draft itself when given one (build_proposer does)
        self.mask_token_id, self.max_depth = pard.mask_token_id, type(pard).max_draft_depth(pard.config)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        k = request.shape.depth
        rows = [self._root_logits()[None]]
        if k > 1:
            masks = torch.full((1, k - 1), self.mask_token_id, dtype=torch.long, device=self.device)
            rows.append(self._aligned(self.cache.forward(masks, head=self.head)[0]))
            self._forget_draft()
        draft, self.last_confidences = positional_draft(torch.cat(rows), request.shape, request.sampling, self.device)
        return draft
