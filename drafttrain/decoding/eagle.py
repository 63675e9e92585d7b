"""The ``eagle`` proposer: a trained EAGLE head (EAGLE-3, or EAGLE-1/2) drafting chains, static trees or EAGLE-2
dynamic trees.

The head's KV cache holds one entry per (target hidden state, following token) pair of the accepted text, so
it grows by exactly the m tokens emitted per step (the engine hands those pairs to ``accept``). Draft nodes
are appended while proposing and cropped afterwards. Which tokens to draft is drafttrain.decoding.expand's;
only how one level is fed is the head's: each node's input is its parent's output hidden.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.expand import TreeDrafter
from drafttrain.decoding.proposers import register_proposer, trained_draft
from drafttrain.decoding.trees import feed_mask
from drafttrain.targets import Target


@register_proposer("eagle")
class EagleProposer(TreeDrafter):
    """``draft``: a checkpoint (or run) folder written by drafttrain, or an in-memory EAGLE drafter."""

    def __init__(self, target: Target, *, draft=None):
        self.head = trained_draft(self.name, target, draft)
        self.hidden_layers = self.head.tap_layers
        self.vocab_size = target.vocab_size

    # -- the accepted text -----------------------------------------------------------------------------
    def prefill(self, input_ids, hidden, next_token) -> None:
        self.caches = self.head.new_caches()
        self.length = 0  # pairs in the cache = positions of the accepted text the head has consumed
        self.device = input_ids.device
        self._consume(self.head.fuse(hidden), torch.cat([input_ids[:, 1:], next_token], dim=1))

    def accept(self, tokens, hidden) -> None:
        self._consume(self.head.fuse(hidden), tokens)

    @torch.no_grad()
    def _consume(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        positions = torch.arange(self.length, self.length + tokens.shape[1], device=self.device).unsqueeze(0)
        out, logits = self.head.step(hidden.to(self.head.feature_dtype), tokens, positions, self.caches)
        self.length += tokens.shape[1]
        self.root_hidden, self.root_logits = out[:, -1:], logits[0, -1]

    # -- drafting (drafttrain.decoding.expand's TreeDrafter: one level per head forward) -------------------
    def _root_logits(self) -> torch.Tensor:
        self.node_hidden: dict[int, torch.Tensor] = {-1: self.root_hidden}
        return self.root_logits

    def _feed(self, nodes, tokens, parents, depths) -> torch.Tensor:
        """One head forward over tree ``nodes``: (parent's output hidden, node token) at position length-1+depth,
        each seeing the accepted text, its ancestors and itself."""
        allowed = torch.cat([torch.ones(len(nodes), self.length, dtype=torch.bool),
                             feed_mask(parents, self.fed, nodes)], dim=1).to(self.device)
        hidden = torch.cat([self.node_hidden[parents[n]] for n in nodes], dim=1)
        ids = torch.tensor([[tokens[n] for n in nodes]], device=self.device)
        pos = torch.tensor([[self.length - 1 + depths[n] for n in nodes]], device=self.device)
        out, logits = self.head.step(hidden, ids, pos, self.caches, allowed)
        for row, n in enumerate(nodes):
            self.node_hidden[n] = out[:, row : row + 1]
        self.fed.extend(nodes)
        return logits[0]

    def _forget_draft(self) -> None:
        for cache in self.caches:
            cache.crop(self.length)
