"""Drafting a chain or a tree from next-token logits, one level per drafter forward: shared by every proposer whose
drafter predicts the next token autoregressively (a draft model, an EAGLE head).

A subclass says how to get the root's logits, how to feed tree nodes (``_feed``: one forward over nodes whose
ancestors were fed before, under drafttrain.decoding.trees.feed_mask) and how to forget the drafted nodes
afterwards; this class decides which tokens to draft:

* chains: k single-token forwards, each node the top-1 (greedy) or a draw from q (sampling);
* static trees: each node's children are its top-m candidates (greedy) or m draws without replacement from q;
* dynamic trees (EAGLE-2): expand the top_k best nodes per level by cumulative log-probability, then keep the
  total_tokens best; candidates are the top-k, so the draft is deterministic (q = one-hot at verification, as
  in EAGLE), which keeps sampling lossless despite the data-dependent pruning.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.proposers import DraftRequest, Proposer
from drafttrain.decoding.trees import Chain, Draft, DynamicTree, StaticTree, children_lists
from drafttrain.sampling import probabilities, sample_without_replacement, top_probability


class TreeDrafter(Proposer):
    device: torch.device
    record_confidences = False  # set to keep, per chain, the draft's top probability at each drafted position
    last_confidences: list[float]

    # -- what a subclass provides --------------------------------------------------------------------------
    def _root_logits(self) -> torch.Tensor:
        """Logits [V] for the root's children (the drafter has consumed the accepted text)."""
        raise NotImplementedError

    def _feed(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
        """One drafter forward over tree ``nodes`` (their ancestors already fed) -> their logits [len(nodes), V]."""
        raise NotImplementedError

    def _forget_draft(self) -> None:
        """Drop the drafted nodes from the drafter's cache: only accepted text stays."""
        raise NotImplementedError

    # -- drafting ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        root = self._root_logits()
        self.fed: list[int] = []  # tree nodes in the drafter's cache after the accepted text, in order
        shape = request.shape
        if isinstance(shape, Chain):
            draft = self._chain(root, shape, request)
        elif isinstance(shape, StaticTree):
            draft = self._static(root, shape, request)
        else:
            draft = self._dynamic(root, shape, request)
        self._forget_draft()
        return draft

    def _draw(self, logits: torch.Tensor, m: int, request: DraftRequest) -> tuple[list[int], torch.Tensor | None]:
        """m candidates for one node: its top-m (greedy) or m draws without replacement from q (sampling)."""
        if request.sampling.greedy:
            return torch.topk(logits, m).indices.tolist(), None
        q = probabilities(logits, request.sampling)
        return [t for t in sample_without_replacement(q, m, request.generator).tolist() if t >= 0], q

    def _chain(self, logits: torch.Tensor, shape: Chain, request: DraftRequest) -> Draft:
        tokens, parents, depths, qs = [], [], [], []
        confidence, self.last_confidences = 1.0, []
        for i in range(shape.depth):
            if i:
                logits = self._feed([i - 1], tokens, parents, depths)[0]
            if shape.min_confidence > 0 or self.record_confidences:
                top = top_probability(logits, request.sampling)
                confidence *= top
                if shape.stops_at(confidence):
                    break
                self.last_confidences.append(top)
            (tok,), q = self._draw(logits, 1, request)
            tokens.append(tok)
            parents.append(i - 1)
            depths.append(i + 1)
            qs.append(q)
        q = None if request.sampling.greedy or not qs else torch.stack(qs)[None]
        return Draft.chain(torch.tensor([tokens], dtype=torch.long, device=self.device).reshape(1, -1), q)

    def _static(self, root: torch.Tensor, shape: StaticTree, request: DraftRequest) -> Draft:
        kids = children_lists(tuple(shape.parents))
        tokens: list[int | None] = [None] * len(shape)
        q_rows: dict[int, torch.Tensor] = {}
        node_logits = {-1: root}
        for depth in range(1, shape.depth + 1):
            for parent, logits in node_logits.items():
                cand, q_rows[parent] = self._draw(logits, len(kids[parent + 1]), request)
                for child, tok in zip(kids[parent + 1], cand):  # fewer candidates than children (top-p): prune
                    tokens[child] = tok
            frontier = [n for n, d in enumerate(shape.depths) if d == depth and tokens[n] is not None and kids[n + 1]]
            if not frontier:
                break
            logits = self._feed(frontier, tokens, shape.parents, shape.depths)
            node_logits = {n: logits[i] for i, n in enumerate(frontier)}
        return tree_draft(tokens, shape.parents, None if request.sampling.greedy else q_rows, self.device)

    def _dynamic(self, root: torch.Tensor, shape: DynamicTree, request: DraftRequest) -> Draft:
        def logprobs(logits):
            if request.sampling.greedy:
                return torch.log_softmax(logits.float(), dim=-1)
            return probabilities(logits, request.sampling).log()

        vals, idx = torch.topk(logprobs(root), shape.top_k)
        tokens, scores = idx.tolist(), vals.tolist()
        parents, depths = [-1] * len(tokens), [1] * len(tokens)
        frontier = [i for i, s in enumerate(scores) if s > float("-inf")]
        for depth in range(2, shape.depth + 1):
            if not frontier:
                break
            lp = logprobs(self._feed(frontier, tokens, parents, depths))
            lp = lp + torch.tensor([scores[n] for n in frontier], device=lp.device)[:, None]
            vals, idx = torch.topk(lp, shape.top_k, dim=-1)  # [m, k] children per frontier node
            first = len(tokens)
            for row, n in enumerate(frontier):
                tokens += idx[row].tolist()
                scores += vals[row].tolist()
                parents += [n] * shape.top_k
                depths += [depth] * shape.top_k
            best = torch.topk(vals.flatten(), min(shape.top_k, vals.numel())).indices.tolist()
            frontier = sorted(first + b for b in best if scores[first + b] > float("-inf"))
        # rerank: the total_tokens best by cumulative score (parents never score below children: ancestor-closed)
        alive = [i for i in range(len(tokens)) if scores[i] > float("-inf")]
        order = sorted(alive, key=lambda i: (-scores[i], depths[i], i))
        keep = set(order[: shape.total_tokens])
        kept = [tok if i in keep else None for i, tok in enumerate(tokens)]
        return tree_draft(kept, parents, None, self.device)


def tree_draft(tokens: list, parents: list[int], q_rows: dict | None, device) -> Draft:
    """Draft from nodes in topological order, dropping those whose token is None (and their descendants)."""
    new_index: dict[int, int] = {}
    out_tokens, out_parents = [], []
    for n, (tok, parent) in enumerate(zip(tokens, parents)):
        if tok is None or (parent >= 0 and parent not in new_index):
            continue
        new_index[n] = len(out_tokens)
        out_tokens.append(tok)
        out_parents.append(-1 if parent < 0 else new_index[parent])
    q = None
    if q_rows is not None:
        some = next(iter(q_rows.values()))
        q = some.new_zeros(1, len(out_tokens) + 1, some.shape[-1])
        for old, row in q_rows.items():
            if old < 0 or old in new_index:
                q[0, 0 if old < 0 else new_index[old] + 1] = row
    return Draft(torch.tensor([out_tokens], dtype=torch.long, device=device), out_parents, q)
