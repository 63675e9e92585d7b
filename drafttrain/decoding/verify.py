"""Verification rules as pure tensor functions: token ids and probabilities in, accepted length and next token out.

No model is involved, so each rule can be tested on a vocabulary of five tokens.

* Greedy (T = 0): accept while the draft token equals the target's argmax; at the first mismatch emit the
  target's token (a *bonus* token when every draft token was accepted). The output equals greedy decoding.
* Chains, sampling (Leviathan et al. 2023, Chen et al. 2023): accept x ~ q with probability min(1, p(x)/q(x));
  on rejection sample from the residual norm(max(0, p - q)); after k acceptances sample the bonus from p.
* Trees, sampling (SpecInfer / EAGLE-2): at a node whose children x1..xm were drawn from q without replacement,
  try them in order: accept xi with min(1, p(xi)/q(xi)); on rejection p <- norm(max(0, p - q)) and
  q <- q with xi removed, renormalised; when all are rejected sample from the last residual p.
  By induction every node emits exactly p, so the output distribution is the target's.
* A deterministic draft (prompt lookup, top-k trees) passes q = None: each candidate is treated as drawn from
  the one-hot q = delta(xi) (accept with p(xi); residual = p with xi removed). That is lossless for any rule
  that picks candidates from the context alone, including EAGLE-2's data-dependent pruning.

``p`` is always the *warped* target distribution (temperature, top-k, top-p: ``drafttrain.sampling``) and the
draft warps its q with the same ``Sampling``.
"""

from __future__ import annotations

import torch

from drafttrain.decoding.trees import children_lists
from drafttrain.sampling import sample


def accepts(u, p_x, q_x):
    """The acceptance test u < min(1, p(x)/q(x)) for u ~ U[0, 1), written without a division (tensors or floats)."""
    return u * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis. Where it is all zero (p == q: a rejection had probability 0 and
    can only come from rounding) fall back to p."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def expected_acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that one token x ~ q is accepted against p: sum_x min(p(x), q(x)) (any leading shape)."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def _one_hot_like(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p).scatter_(-1, x.unsqueeze(-1), 1.0)


def verify_chain_greedy(draft: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, k], target_tokens [B, k+1] (the target's argmax after the root and after each draft token).
    Returns (accepted [B], next_token [B])."""
    k = draft.shape[1]
    accepted = (draft == target_tokens[:, :k]).long().cumprod(-1).sum(-1)
    return accepted, target_tokens.gather(1, accepted[:, None])[:, 0]


def verify_chain(
    draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan/Chen rejection sampling, vectorised over the batch.

    draft [B, k]; p [B, k+1, V] target probabilities after the root and after each draft token;
    q [B, k, V] the distribution each draft token was drawn from, or None for a deterministic draft.
    Returns (accepted [B], next_token [B]).
    """
    batch, k = draft.shape
    rows = torch.arange(batch, device=p.device)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long, device=p.device), sample(p[:, 0], generator)
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(batch, k, generator=generator, device=p.device, dtype=p.dtype)
    accepted = accepts(u, p_x, q_x).long().cumprod(-1).sum(-1)
    p_n = p[rows, accepted]
    at = accepted.clamp(max=k - 1)
    q_n = _one_hot_like(p_n, draft[rows, at]) if q is None else q[rows, at]
    dist = torch.where((accepted < k)[:, None], residual(p_n, q_n), p_n)
    return accepted, sample(dist, generator)


def verify_tree_greedy(
    tokens: torch.Tensor, parents: list[int], target_tokens: torch.Tensor
) -> tuple[list[int], int]:
    """tokens [N], parents (see trees.Draft), target_tokens [N+1] (argmax after the root and after each node;
    anything indexable by row works, so the engine can take the argmax of visited rows only).
    Returns (accepted node indices root->leaf, next_token)."""
    tok, kids = tokens.tolist(), children_lists(tuple(parents))
    node, path = -1, []
    while True:
        want = int(target_tokens[node + 1])
        match = next((c for c in kids[node + 1] if tok[c] == want), None)
        if match is None:
            return path, want
        node = match
        path.append(node)


def verify_tree(
    tokens: torch.Tensor,
    parents: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling down a tree.

    tokens [N]; p [N+1, V] target probabilities after the root (row 0) and after node i (row i+1) (anything
    indexable by row works, so the engine can warp rows lazily); q [N+1, V] the distribution each node's
    children were drawn from without replacement (row 0 = root's), or None for a deterministic draft.
    Returns (accepted node indices root->leaf, next_token).
    """
    tok, kids = tokens.tolist(), children_lists(tuple(parents))
    uniforms = torch.rand(len(tok), generator=generator, dtype=torch.float64, device=tokens.device).tolist()
    node, path = -1, []
    p_cur, q_cur = p[0], None if q is None else q[0]
    while True:
        for child in kids[node + 1]:
            x = tok[child]
            q_used = _one_hot_like(p_cur, torch.tensor(x, device=p_cur.device)) if q_cur is None else q_cur
            if accepts(uniforms[child], float(p_cur[x]), float(q_used[x])):
                node = child
                path.append(child)
                p_cur, q_cur = p[child + 1], None if q is None else q[child + 1]
                break
            p_cur = residual(p_cur, q_used)
            if q_cur is not None:
                q_cur = q_cur.clone()
                q_cur[x] = 0
                q_cur = q_cur / q_cur.sum().clamp_min(torch.finfo(q_cur.dtype).tiny)
        else:
            return path, int(sample(p_cur, generator))
