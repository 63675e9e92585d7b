"""Draft shapes (chain, static Medusa-style tree, dynamic EAGLE-2 tree), the ``Draft`` a proposer returns,
and the attention masks that let one forward score a whole tree.

A draft tree has N nodes in topological order. ``parents[i]`` is the index of node i's parent, or -1 when the
parent is the *root*: the last emitted token, which is not in the KV cache yet and is the first input of the
verification forward. A chain of k tokens is the tree ``parents = [-1, 0, 1, ..., k-2]``. A draft may carry side
tokens (``SideTokens``): tokens its proposer runs through the same forward for its own use, never verified.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
from pathlib import Path
from typing import Any, Union

import torch

from drafttrain import DrafttrainError


@dataclasses.dataclass(frozen=True)
class Chain:
    """A single line of up to ``depth`` draft tokens (classic speculative decoding).

    ``min_confidence`` > 0 stops a drafter early when unsure: position i is drafted only while the product of the
    draft's top probabilities at positions 1..i (EAGLE-2's estimate that the path is accepted) stays at or above it.
    The rule reads the draft's distributions, never the token about to be drawn, so sampling stays lossless."""
    depth: int = 5
    min_confidence: float = 0.0

    def __post_init__(self):
        _check_positive("depth (draft tokens per step)", self.depth)
        if not isinstance(self.min_confidence, (int, float)) or not 0 <= self.min_confidence < 1:
            raise DrafttrainError(f"min_confidence must be in [0, 1), got {self.min_confidence!r}")

    def stops_at(self, confidence: float) -> bool:
        """Whether a path whose top probabilities multiply to ``confidence`` is not drafted (the one stop rule)."""
        return confidence < self.min_confidence


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-dependent tree: expand the ``top_k`` best nodes per level for ``depth`` levels (each
    with ``top_k`` children), then keep the ``total_tokens`` candidates with the highest cumulative draft
    log-probability. That set is always ancestor-closed, since a child's score is never above its parent's."""
    total_tokens: int = 60
    depth: int = 6
    top_k: int = 8

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            _check_positive(f"DynamicTree.{name}", getattr(self, name))


class StaticTree:
    """A fixed tree given as Medusa-style paths: each path lists, level by level, the rank of the child among
    its parent's top-k draft candidates (``[[0], [1], [0, 0], [0, 1], [1, 0]]``: two root children, the best
    one with two children of its own, the second with one). Every path's prefix must be listed too, and the
    ranks under one parent must be 0..m-1, so the children are always the *first* m candidates drawn."""
    def __init__(self, paths: list[list[int]]):
        clean = sorted({tuple(_check_path(p)) for p in paths}, key=lambda p: (len(p), p))
        if not clean:
            raise DrafttrainError("a static tree needs at least one path, e.g. [[0], [0, 0]]")
        index = {p: i for i, p in enumerate(clean)}
        for p in clean:
            if len(p) > 1 and p[:-1] not in index:
                raise DrafttrainError(f"static tree path {list(p)} is listed without its prefix {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise DrafttrainError(
                    f"static tree path {list(p)} skips a sibling: {list(p[:-1] + (p[-1] - 1,))} is missing "
                    "(the children of a node must be its candidates of rank 0..m-1)"
                )
        self.paths = [list(p) for p in clean]
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in clean]
        self.ranks = [p[-1] for p in clean]
        self.depths = [len(p) for p in clean]
        self.depth = max(self.depths)

    def __len__(self) -> int:
        return len(self.paths)

    def __repr__(self) -> str:
        return f"StaticTree({self.paths})"


TreeShape = Union[Chain, StaticTree, DynamicTree]


def build_static_tree(accuracies: list[list[float]], size: int) -> list[list[int]]:
    """Medusa's tree tool: the ``size`` paths most likely to be accepted, given ``accuracies[d][r]`` = how often the
    rank-r candidate at depth d+1 is the right token (per head for Medusa). A path is accepted with the product of
    its ranks' accuracies, so a tree's expected accepted length is the sum over its nodes; the best ``size``
    nodes are taken greedily (ancestor- and sibling-closed: accuracies are made non-increasing in rank)."""
    if size <= 0 or not accuracies or not accuracies[0]:
        raise DrafttrainError(f"a static tree needs a positive size and accuracies, got size {size}")
    acc = []
    for row in accuracies:  # non-increasing in rank, so a chosen rank r always has ranks 0..r-1 beside it
        floor, clean = 1.0, []
        for a in row:
            floor = min(floor, max(float(a), 1e-9))
            clean.append(floor)
        acc.append(clean)
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    chosen: list[list[int]] = []
    while heap and len(chosen) < size:
        negative, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < len(acc):
            for r, a in enumerate(acc[len(path)]):
                heapq.heappush(heap, (negative * a, path + (r,)))
    return chosen


def expected_tree_tokens(paths: list[list[int]], accuracies: list[list[float]]) -> float:
    """Expected tokens per step of a static tree: 1 (the target's own) + the sum of its paths' acceptance."""
    total = 1.0
    for path in paths:
        product = 1.0
        for depth, rank in enumerate(path):
            product *= accuracies[depth][rank] if rank < len(accuracies[depth]) else 0.0
        total += product
    return total


def tree_from_spec(spec: str, depth: int, total_tokens: int = 60, top_k: int = 10):
    """A tree as recipes and the CLI name it: ``chain``; ``dynamic`` (EAGLE-2, ``depth`` levels); a named static
    tree (NAMED_TREES); a .json file holding a list of paths; or ``static:`` followed by the JSON list."""
    if spec == "chain":
        return "chain"
    if spec == "dynamic":
        return DynamicTree(total_tokens=total_tokens, depth=depth, top_k=top_k)
    if spec in NAMED_TREES:
        return StaticTree(NAMED_TREES[spec])
    text = spec.removeprefix("static:")
    source = Path(text)
    try:
        raw = json.loads(source.read_text() if source.suffix == ".json" and source.is_file() else text)
    except (json.JSONDecodeError, OSError):
        if not spec.startswith("static:") and not source.suffix == ".json":
            raise DrafttrainError(f"unknown tree {spec!r}: use chain, dynamic, one of {', '.join(NAMED_TREES)}, a "
                                  ".json file of paths, or static:PATHS_JSON") from None
        raise DrafttrainError(f"tree {spec!r}: neither a JSON list of paths nor a readable .json file") from None
    valid = isinstance(raw, list) and raw and all(
        isinstance(p, list) and p and all(isinstance(i, int) and i >= 0 for i in p) for p in raw)
    if not valid:
        raise DrafttrainError(f"tree {spec!r}: expected a non-empty list of paths like [[0], [1], [0, 0]]")
    return StaticTree(raw)


# Named static trees, built from a typical Medusa profile (per head: top-1 accuracy, each next rank 0.35x the
# previous). `drafttrain eval --tree medusa-16` etc.; a tree built from a draft's own measured accuracies is better.
TYPICAL_HEAD_TOP1 = (0.6, 0.4, 0.3, 0.25)
NAMED_TREES = {
    f"medusa-{size}": build_static_tree([[top1 * 0.35**r for r in range(8)] for top1 in TYPICAL_HEAD_TOP1], size)
    for size in (4, 8, 16, 32, 64)
}


def tree_of(settings) -> Any:
    """A DecodeSettings' tree as the engine and the auto choice take it: a spec named as recipes and the CLI name
    it is parsed (``tree_from_spec``, no deeper than the settings may draft); "chain", "auto", a list of paths
    or a shape object stay as they are."""
    tree = settings.tree
    if isinstance(tree, str) and tree not in ("chain", "auto"):
        return tree_from_spec(tree, settings.deepest, settings.total_tokens, settings.tree_top_k)
    return tree


def drafted_depth(tree, depth: int | str) -> int | str:
    """The depth a tree drafts: a static tree's (or a list of paths') own, whatever depth is set beside it; the
    set depth for a chain or a dynamic tree (or "auto", until chosen)."""
    if isinstance(tree, StaticTree):
        return tree.depth
    if isinstance(tree, (list, tuple)) and tree:
        return max(len(path) for path in tree)
    return depth


def check_tree_depth(settings, depth_name: str = "--depth", tree_name: str = "--tree") -> None:
    """A depth given beside a static tree cannot act (the tree drafts to its own depth): refused unless it is that
    depth, so that no report claims a depth that was not drafted. ``*_name``: the settings' names for the user."""
    tree = tree_of(settings)
    own = drafted_depth(tree, settings.depth)
    if "depth" in settings.model_fields_set and own != settings.depth:
        raise DrafttrainError(f"{depth_name} {settings.depth} cannot act on {tree_name} {settings.tree}: a static tree "
                              f"drafts to its own depth ({own}); leave {depth_name} out, or draft {settings.depth} "
                              f"deep with {tree_name} chain or dynamic")


def as_shape(tree, depth: int, min_confidence: float = 0.0) -> TreeShape:
    """The engine's ``tree=`` argument ("chain", a list of paths, a StaticTree or a DynamicTree) as a shape."""
    if isinstance(tree, (Chain, StaticTree, DynamicTree)):
        return tree
    if tree == "chain":
        return Chain(depth, min_confidence)
    if isinstance(tree, (list, tuple)):
        return StaticTree([list(p) for p in tree])
    raise DrafttrainError(
        f"tree={tree!r} is not understood: use 'chain', a list of paths like [[0], [1], [0, 0]], "
        "or DynamicTree(total_tokens=..., depth=..., top_k=...)"
    )


@dataclasses.dataclass
class SideTokens:
    """Tokens a proposer adds to the verification forward for its own use (lookahead decoding's Jacobi window): fed
    after the root and the draft's N nodes, never candidates, never accepted or emitted, and dropped from the cache
    with the refused nodes.

    tokens:  LongTensor [1, S]
    offsets: S ints, each token's position after the root's (the root is at 0, a draft node at its depth)
    sees:    Bool [S, 1 + N + S]: which of (the root, the draft's nodes, the side tokens) each side token attends
             to; the cache before the root is seen by every token (within a layer's window). No draft node sees a
             side token, so the draft is verified exactly as it would be without them.
    logits:  set by the engine after the forward: the target's logits at the side tokens [S, V], for the proposer
             to read when the step's emitted tokens reach it (``Proposer.accept``).
    """
    tokens: torch.Tensor
    offsets: list[int]
    sees: torch.Tensor
    logits: torch.Tensor | None = None

    def __post_init__(self):
        self.offsets = [int(o) for o in self.offsets]
        size = len(self.offsets)
        if self.tokens.dim() != 2 or self.tokens.shape[1] != size or self.sees.dim() != 2 or len(self.sees) != size:
            raise ValueError(f"SideTokens: tokens {tuple(self.tokens.shape)}, {size} offsets and sees "
                             f"{tuple(self.sees.shape)} do not describe the same tokens")

    def __len__(self) -> int:
        return len(self.offsets)


@dataclasses.dataclass
class Draft:
    """What a proposer returns: N draft tokens arranged as a tree (a chain is a tree).

    tokens:  LongTensor [1, N]
    parents: N ints, ``parents[i] < i``; -1 means the root (the last emitted token)
    q:       None for a deterministic draft (each token is a fixed function of the context: prompt lookup,
             greedy/top-k drafting; verification then uses q = one-hot), or FloatTensor [1, N+1, V] where
             row 0 is the distribution the root's children were drawn from and row i+1 the distribution node
             i's children were drawn from, *without replacement, in node order* (the first child ~ q, the
             second ~ q with the first removed, ...). Rows of leaves are ignored (may be zero).
    side:    None, or tokens the proposer runs through the verification forward beside the draft (SideTokens)
    """
    tokens: torch.Tensor
    parents: list[int]
    q: torch.Tensor | None = None
    side: SideTokens | None = None

    def __post_init__(self):
        self.parents = [int(p) for p in self.parents]
        if self.tokens.dim() != 2 or self.tokens.shape[1] != len(self.parents):
            raise ValueError(f"Draft: tokens {tuple(self.tokens.shape)} do not match {len(self.parents)} parents")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"Draft: parents must precede their children, got {self.parents}")
        if self.q is not None and self.q.shape[1] != len(self.parents) + 1:
            raise ValueError(f"Draft: q has {self.q.shape[1]} rows, expected {len(self.parents) + 1}")
        if self.side is not None and self.side.sees.shape[1] != len(self.parents) + 1 + len(self.side):
            raise ValueError(f"Draft: side tokens' sees has {self.side.sees.shape[1]} columns, expected "
                             f"{len(self.parents) + 1 + len(self.side)} (the root, {len(self.parents)} nodes, "
                             f"{len(self.side)} side tokens)")
        self.depths = node_depths(tuple(self.parents))

    @classmethod
    def chain(cls, tokens: torch.Tensor, q: torch.Tensor | None = None) -> "Draft":
        """tokens [1, k]; q [1, k, V] (q[:, i] is what token i was drawn from) or None."""
        k = tokens.shape[1]
        if q is not None:
            q = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[2])], dim=1)
        return cls(tokens, list(range(-1, k - 1)), q)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "Draft":
        return cls(torch.empty(1, 0, dtype=torch.long, device=device), [])

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Depth of the deepest node (0 for an empty draft)."""
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    @property
    def width(self) -> int:
        """The tokens its verification forward feeds: the root, the nodes and any side tokens."""
        return 1 + len(self) + (0 if self.side is None else len(self.side))


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise DrafttrainError(f"{name} must be a positive integer, got {value!r}")


def _check_path(path) -> list[int]:
    if not isinstance(path, (list, tuple)) or not path or not all(isinstance(r, int) and r >= 0 for r in path):
        raise DrafttrainError(f"static tree path {path!r} must be a non-empty list of child ranks >= 0")
    return list(path)


@functools.lru_cache(maxsize=256)
def node_depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Depth of every node (the root's children have depth 1). Cached: returns an immutable tuple."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return tuple(depths)


@functools.lru_cache(maxsize=256)
def children_lists(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``out[i + 1]`` lists the children of node i in order; ``out[0]`` the root's children. Cached, immutable."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return tuple(tuple(c) for c in out)


@functools.lru_cache(maxsize=256)
def ancestor_matrix(parents: tuple[int, ...]) -> torch.Tensor:
    """Bool [N+1, N+1] over (root, node 0, ..., node N-1): entry [i, j] is True when j is i or an ancestor of i.
    Cached per topology: do not modify the returned tensor."""
    n = len(parents) + 1
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i + 1] |= anc[p + 1]
    return anc


def feed_mask(parents: list[int], fed: list[int], nodes: list[int]) -> torch.Tensor:
    """Bool [len(nodes), len(fed) + len(nodes)]: which of the tree nodes already in a drafter's cache (``fed``, in
    cache order) and which of the ``nodes`` being fed now each of ``nodes`` may see: its ancestors and itself.
    The one tree mask for drafting, from the same ancestor relation that verification uses."""
    anc = ancestor_matrix(tuple(parents))
    rows = torch.tensor([n + 1 for n in nodes])
    cols = torch.tensor([n + 1 for n in [*fed, *nodes]])
    return anc[rows][:, cols]


def tree_position_ids(parents: list[int], prefix_len: int, device) -> torch.Tensor:
    """position_ids [1, N+1] for (root, nodes...): prefix_len + depth, the root at depth 0."""
    return torch.tensor([[prefix_len] + [prefix_len + d for d in node_depths(tuple(parents))]], device=device)


def verification_layout(draft: Draft, prefix_len: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The position ids [1, W] and the attention rule [W, W] (``allowed``, as targets.TargetCache.forward takes it)
    of the one forward that verifies ``draft``, W = draft.width: the root, the nodes (each sees its ancestors), then
    any side tokens (each sees what its ``sees`` says). (None, None) for a chain alone: plain causal attention."""
    if draft.side is None and draft.is_chain:
        return None, None
    positions = tree_position_ids(draft.parents, prefix_len, device)
    allowed = ancestor_matrix(tuple(draft.parents))
    if draft.side is not None:
        side = draft.side
        offsets = torch.tensor([side.offsets], device=device)
        positions = torch.cat([positions, prefix_len + offsets], dim=1)
        blind = torch.zeros(len(allowed), len(side), dtype=torch.bool)  # no node sees a side token
        allowed = torch.cat([torch.cat([allowed, blind], dim=1), side.sees.cpu().bool()])
    return positions, allowed

