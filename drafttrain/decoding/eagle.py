"""EAGLE proposers: a trained EAGLE-3 or EAGLE-1/2 head drafting chains, static trees or EAGLE-2 dynamic trees.

The head's KV cache holds one entry per (target hidden state, following token) pair of the accepted text, so
it grows by exactly the m tokens emitted per step (the engine hands those pairs to ``accept``). Draft nodes
are appended while proposing and cropped afterwards. Tree expansion and reranking are shared with the
draft-model proposer; only how one level is fed differs: each node's input is its parent's output hidden.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafttrain import DrafttrainError
from drafttrain.decoding.proposers import DraftModelProposer, DraftRequest, register_proposer
from drafttrain.decoding.trees import Chain, Draft, StaticTree


class EagleProposer(DraftModelProposer):
    def __init__(self, target, *, draft=None):
        from drafttrain.drafts import DraftHead, load_draft

        if draft is None or draft == "":
            raise DrafttrainError(f"the {self.name!r} proposer needs draft=<a checkpoint folder written by drafttrain>")
        if isinstance(draft, DraftHead):
            self.head = draft
        else:
            if not Path(draft).is_dir():
                raise DrafttrainError(f"EAGLE draft checkpoint not found: {draft}")
            self.head = load_draft(draft, target)
        if self.head.kind != self.expected_kind:
            raise DrafttrainError(f"proposer {self.name!r} needs an {self.expected_kind} head, {draft} is {self.head.kind}")
        self.head.eval()
        self.hidden_layers = self.head.target_layers
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
        out, logits = self.head.step(hidden.to(self.head.fc.weight.dtype), tokens, positions, self.caches)
        self.length += tokens.shape[1]
        self.root_hidden, self.root_logits = out[:, -1:], logits[0, -1]

    # -- drafting ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        self.ctx = self.length
        self.fed: list[int] = []
        self.node_hidden: dict[int, torch.Tensor] = {-1: self.root_hidden}
        self.ids = torch.empty(1, 0, dtype=torch.long, device=self.device)  # the shared tree code reads .ids.device
        shape = request.shape
        if isinstance(shape, Chain):
            draft = self._chain(self.root_logits, shape.depth, request)
        elif isinstance(shape, StaticTree):
            draft = self._static(self.root_logits, shape, request)
        else:
            draft = self._dynamic(self.root_logits, shape, request)
        for cache in self.caches:
            cache.crop(self.length)
        return draft

    def _chain(self, logits: torch.Tensor, depth: int, request: DraftRequest) -> Draft:
        tokens, parents, depths = [], [], []
        qs = []
        for i in range(depth):
            if i:
                logits = self._feed([i - 1], tokens, parents, depths)[0]
            (tok,), q = self._draw(logits, 1, request)
            tokens.append(tok)
            parents.append(i - 1)
            depths.append(i + 1)
            qs.append(q)
        q = None if request.sampling.greedy else torch.stack(qs)[None]
        return Draft.chain(torch.tensor([tokens], device=self.device), q)

    def _feed(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
        """One head forward over tree ``nodes``: (parent's output hidden, node token) at position ctx-1+depth,
        each seeing the accepted text, its ancestors and itself. Returns their logits [len(nodes), V]."""
        slot = {n: i for i, n in enumerate(self.fed)}
        allowed = torch.zeros(len(nodes), self.ctx + len(self.fed) + len(nodes), dtype=torch.bool, device=self.device)
        allowed[:, : self.ctx] = True
        for row, n in enumerate(nodes):
            allowed[row, self.ctx + len(self.fed) + row] = True
            a = parents[n]
            while a >= 0:
                allowed[row, self.ctx + slot[a]] = True
                a = parents[a]
        hidden = torch.cat([self.node_hidden[parents[n]] for n in nodes], dim=1)
        ids = torch.tensor([[tokens[n] for n in nodes]], device=self.device)
        pos = torch.tensor([[self.ctx - 1 + depths[n] for n in nodes]], device=self.device)
        out, logits = self.head.step(hidden, ids, pos, self.caches, allowed)
        for row, n in enumerate(nodes):
            self.node_hidden[n] = out[:, row : row + 1]
        self.fed.extend(nodes)
        return logits[0]


@register_proposer("eagle3")
class Eagle3Proposer(EagleProposer):
    """A trained EAGLE-3 head (``draft`` = checkpoint folder or an in-memory head)."""

    expected_kind = "eagle3"


@register_proposer("eagle")
class Eagle1Proposer(EagleProposer):
    """A trained EAGLE-1/2 head (``draft`` = checkpoint folder or an in-memory head)."""

    expected_kind = "eagle"
