"""The ``eagle`` proposer for P-EAGLE heads (drafttrain.drafts.peagle): the last real pair drafts token 1, and k - 1
mask slots after it draft tokens 2..k, all in one head forward."""

from __future__ import annotations

import torch

from drafttrain.decoding.eagle import EagleProposer
from drafttrain.decoding.positional import positional_draft
from drafttrain.decoding.proposers import DraftRequest, register_proposer_variant
from drafttrain.decoding.trees import Chain, Draft, StaticTree
from drafttrain.drafts.peagle import PEagleDrafter
from drafttrain.targets import Target


@register_proposer_variant("eagle", serves=PEagleDrafter)
class PEagleProposer(EagleProposer):
    shapes = (Chain, StaticTree)  # every position's distribution from one forward: no tree that grows by level

    def __init__(self, target: Target, *, draft=None):
        super().__init__(target, draft=draft)
        self.max_depth = type(self.head).max_draft_depth(self.head.config)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        # the last real pair gave depth 1 (root_logits); depths 2..k come from k - 1 mask slots at the next
        # positions, one forward, each seeing the accepted text and the earlier mask slots (causal)
        k = request.shape.depth
        rows = [self.root_logits[None]]
        if k > 1:
            hidden = self.head.mask_hidden_fused().expand(1, k - 1, -1)
            tokens = torch.full((1, k - 1), self.head.mask_token_id, dtype=torch.long, device=self.device)
            positions = torch.arange(self.length, self.length + k - 1, device=self.device).unsqueeze(0)
            rows.append(self.head.step(hidden, tokens, positions, self.caches)[1][0])
            self._forget_draft()
        draft, self.last_confidences = positional_draft(torch.cat(rows), request.shape, request.sampling, self.device)
        return draft
