"""The ``block`` proposer: a block drafter (DFlash) proposes every token of its draft in one forward.

The drafter keeps, per layer, the keys and values of its context: the fused target states of every position of the
accepted text (the prompt at prefill, then the root and the accepted nodes of each step, which the engine hands
over). A cycle feeds [anchor, MASK x (w - 1)] at the positions after the context, the anchor being the last emitted
token, attending to the whole context and to the block; the block's own keys are not kept. A cycle therefore costs
one forward of w tokens over the cached context. For a chain, w is just the slots the draft depth needs (depth + 1,
or depth in DSpark's mode), as vLLM drafts a block of num_speculative_tokens + 1: a bidirectional block shorter than
the trained one is then seen by its slots as it is served (scripts/tools/serving/replay_block_drafts.py checks vLLM's
drafts cycle by cycle), and only at depth block - 1 does each slot see what it saw in training. A static tree drafts
the whole block, as the rank accuracies its shape is built from were measured.

Candidates come from drafttrain.decoding.positional: each slot's top-1 (a chain) or top-m (a static tree), a
deterministic function of the context, so sampling stays exactly lossless.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.engine import plain_decode
from drafttrain.decoding.positional import positional_draft, rank_hits
from drafttrain.decoding.proposers import DraftRequest, Proposer, register_proposer, trained_draft
from drafttrain.decoding.trees import Chain, Draft, StaticTree
from drafttrain.targets import HiddenStateTap, Target


@register_proposer("block")
class BlockProposer(Proposer):
    """``draft``: a checkpoint (or run) folder written by drafttrain, or an in-memory block drafter."""

    shapes = (Chain, StaticTree)

    def __init__(self, target: Target, *, draft=None):
        self.head = trained_draft(self.name, target, draft)
        self.hidden_layers = self.head.tap_layers
        self.max_depth = type(self.head).max_draft_depth(self.head.config)

    def rank_accuracies(self, target: Target, prompts, max_new_tokens, stop_token_ids):
        return measure_block_rank_accuracies(target, self.head, prompts, max_new_tokens, stop_token_ids)

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device
        self.caches, self.length = self.head.new_caches(), 0
        self._consume(hidden)
        self.anchor = next_token.reshape(1)  # the block's first token: the last emitted one

    def accept(self, tokens, hidden) -> None:
        self._consume(hidden)
        self.anchor = tokens[:, -1]

    @torch.no_grad()
    def _consume(self, hidden: torch.Tensor) -> None:
        """The context keys/values of the positions whose target states ``hidden`` holds (the next ones)."""
        positions = torch.arange(self.length, self.length + hidden.shape[1], device=self.device).unsqueeze(0)
        for cache, (keys, values) in zip(self.caches, self.head.context_keys_values(hidden, positions)):
            cache.append(keys, values)
        self.length += hidden.shape[1]

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        contexts = [(cache.keys, cache.values) for cache in self.caches]
        logits = self.head.draft_block(self.anchor, self.length, contexts, self._width(request.shape))[0]
        draft, self.last_confidences = positional_draft(logits, request.shape, request.sampling, self.device)
        return draft

    def _width(self, shape: Chain | StaticTree) -> int:
        """A chain drafts depth + 1 slots, as vLLM serves it; a static tree drafts the whole trained block, since
        its candidates were chosen from rank accuracies measured with the whole block (measure_block_rank_accuracies)
        and no engine serves a block drafter's tree to agree with."""
        depth = shape.depth if isinstance(shape, Chain) else self.max_depth
        return self.head.first_predicted_slot() + depth


@torch.no_grad()
def measure_block_rank_accuracies(target: Target, drafter, prompts: list[torch.Tensor], max_new_tokens: int,
                                  stop_token_ids: set[int] | None = None, k: int = 8) -> list[list[float]]:
    """``[depth][rank]``: how often the block's rank-r candidate at each drafted depth is the token the target then
    produces (greedy), with a block anchored at every position of the target's own answers to ``prompts``."""
    first, depths = drafter.first_predicted_slot(), drafter.max_draft_depth(drafter.config)
    hits, counted = torch.zeros(depths, k), torch.zeros(depths, 1)
    for prompt in prompts:
        answer = plain_decode(target, prompt, max_new_tokens, stop_token_ids=stop_token_ids).tokens
        ids = torch.cat([prompt, torch.tensor([answer], device=prompt.device)], dim=1)
        with HiddenStateTap(target.model, drafter.tap_layers) as tap:
            target.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            taps = tap.stacked()
        anchors = torch.arange(prompt.shape[1], ids.shape[1], device=ids.device).unsqueeze(0)
        logits = drafter.block_logits_at(taps, ids, anchors)[0, :, first: first + depths]  # [A, depths, V']
        ranked = drafter.draft_to_target[logits.topk(k, dim=-1).indices]
        at = anchors[0, :, None] + first + torch.arange(depths, device=ids.device)
        valid = at < ids.shape[1]
        wanted = ids[0, at.clamp(max=ids.shape[1] - 1)]
        h, n = rank_hits(ranked, wanted, valid)
        hits, counted = hits + h, counted + n
    return (hits / counted.clamp(min=1)).tolist()

