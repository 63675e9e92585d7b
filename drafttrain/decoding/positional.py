"""A draft from per-position logits: drafters whose candidates at every depth come from one forward, each depth's
independent of the tokens drafted before it (Medusa's heads, a block drafter's slots).

A chain takes each depth's top-1, stopping once the product of their top probabilities falls below the chain's
``min_confidence`` (which reads the distributions only); a static tree's node at depth d with rank r is depth d's
r-th candidate. Candidates are a deterministic function of the context (top-k, also when sampling), so verification
treats them as one-hot drafts and sampling stays exactly lossless.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.trees import Chain, Draft, StaticTree
from drafttrain.sampling import Sampling, top_probabilities


def positional_draft(logits: torch.Tensor, shape: Chain | StaticTree, sampling: Sampling,
                     device: torch.device | str) -> tuple[Draft, list[float]]:
    """``logits`` [depths, V] -> (the draft, the top probability at each drafted chain position)."""
    if isinstance(shape, Chain):
        rows = logits[: shape.depth]
        # every depth's top-1 and top probability in two transfers: on a GPU a read per depth is a sync per depth
        tops, best = top_probabilities(rows, sampling).tolist(), rows.argmax(-1).tolist()
        tokens, confidence, confidences = [], 1.0, []
        for top, token in zip(tops, best):
            confidence *= top
            if shape.stops_at(confidence):
                break
            confidences.append(top)
            tokens.append(token)
        return Draft.chain(torch.tensor([tokens], dtype=torch.long, device=device).reshape(1, -1)), confidences
    widest = max(shape.ranks) + 1
    candidates = torch.topk(logits[: shape.depth], widest, dim=-1).indices.tolist()
    tokens = [candidates[d - 1][r] for d, r in zip(shape.depths, shape.ranks)]
    return Draft(torch.tensor([tokens], dtype=torch.long, device=device), shape.parents), []


class MaskSlotDrafting:
    """For a proposer whose draft fills every depth from one forward (P-EAGLE, PARD): the root's logits give depth
    1, and k - 1 mask slots after it, each seeing the accepted text and the earlier slots, give depths 2..k. Mixed in
    before the proposer it completes, which gives ``_first_logits()`` ([V], depth 1), ``_mask_slot_logits(n)``
    ([n, V], the slots fed to the draft's cache) and ``_forget_draft()`` (the slots dropped from it again)."""

    shapes = (Chain, StaticTree)  # every position's distribution from one forward: no tree that grows by level

    @torch.no_grad()
    def propose(self, request) -> Draft:
        k = request.shape.depth
        rows = [self._first_logits()[None]]
        if k > 1:
            rows.append(self._mask_slot_logits(k - 1))
            self._forget_draft()
        draft, self.last_confidences = positional_draft(torch.cat(rows), request.shape, request.sampling, self.device)
        return draft


def rank_hits(ranked: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth and rank, how often the rank-r candidate is the wanted token: ``ranked`` [N, depths, k] candidate
    ids, ``wanted`` [N, depths], ``valid`` [N, depths] -> (hits [depths, k], counted [depths, 1])."""
    hits = ((ranked == wanted.unsqueeze(-1)) & valid.unsqueeze(-1)).float().sum(0)
    return hits.cpu(), valid.float().sum(0).unsqueeze(-1).cpu()  # the callers' running sums live on the CPU
