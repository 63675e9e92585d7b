"""The ``medusa`` proposer: a trained Medusa draft's heads, read off the target's final hidden state, fill a static
tree (Medusa's format: each path lists the rank of the candidate at each depth) or a chain (the top-1 path).

All candidates come from one forward of the heads on the last accepted position's hidden state: the node at depth
d with rank r is head d-1's r-th most likely token (drafttrain.decoding.positional: deterministic candidates, so
sampling stays exactly lossless).

``measure_rank_accuracies`` measures how often each head's rank-r candidate is right while the target decodes, the
input of trees.build_static_tree (Medusa's tree tool), so a tree can be sized for this draft and machine.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.engine import plain_decode
from drafttrain.decoding.positional import positional_draft, rank_hits
from drafttrain.decoding.proposers import DraftRequest, Proposer, register_proposer, trained_draft
from drafttrain.decoding.trees import Chain, Draft, StaticTree
from drafttrain.targets import HiddenStateTap, Target


@register_proposer("medusa")
class MedusaProposer(Proposer):
    """``draft``: a checkpoint (or run) folder written by drafttrain, or an in-memory Medusa drafter."""

    shapes = (Chain, StaticTree)

    def __init__(self, target: Target, *, draft=None):
        self.head = trained_draft(self.name, target, draft)
        self.hidden_layers = [target.num_layers]  # the final (normed) hidden state the heads read
        self.max_depth = type(self.head).max_draft_depth(self.head.config)  # the engine refuses deeper shapes

    def rank_accuracies(self, target: Target, prompts, max_new_tokens, stop_token_ids):
        return measure_rank_accuracies(target, self.head, prompts, max_new_tokens, stop_token_ids=stop_token_ids)

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device
        self.last = hidden[:, -1]

    def accept(self, tokens, hidden) -> None:
        self.last = hidden[:, -1]  # the state whose output is the last emitted token (the next root)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        logits = self.head.head_logits(self.last.to(self.head.lm_heads[0].weight.dtype))[0]  # [K, V]
        draft, self.last_confidences = positional_draft(logits, request.shape, request.sampling, self.device)
        return draft


@torch.no_grad()
def measure_rank_accuracies(target: Target, drafter, prompts: list[torch.Tensor], max_new_tokens: int, k: int = 8,
                            stop_token_ids: set[int] | None = None) -> list[list[float]]:
    """``[head][rank]``: how often head h's rank-r candidate is the token the target then produces (greedy), over
    every position of the target's own answers to ``prompts``."""
    heads = drafter.config.num_heads
    hits, counted = torch.zeros(heads, k), torch.zeros(heads, 1)
    for prompt in prompts:
        tokens = plain_decode(target, prompt, max_new_tokens, stop_token_ids=stop_token_ids).tokens
        ids = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
        with HiddenStateTap(target.model, [target.num_layers]) as tap:
            target.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            hidden = tap.get()[0][0]  # [T, H]
        start = prompt.shape[1] - 1  # the position whose output is the first answer token
        ranked = drafter.head_logits(hidden.to(drafter.lm_heads[0].weight.dtype)).topk(k, dim=-1).indices  # [T,K,k]
        # head h at position t proposes the token at t + 2 + h (the target's own next token is t + 1)
        at = torch.arange(start, ids.shape[1], device=ids.device)[:, None] + 2 + torch.arange(heads, device=ids.device)
        valid = at < ids.shape[1]
        h, n = rank_hits(ranked[start:], ids[0, at.clamp(max=ids.shape[1] - 1)], valid)
        hits, counted = hits + h, counted + n
    return (hits / counted.clamp(min=1)).tolist()
