"""Draft proposers: one small interface, a registry by name, and the two model-free / model-based baselines.

The interface (``Proposer``), as the engine drives it for one ``generate`` call::

    proposer.prefill(input_ids, hidden, next_token)   # once, after the target's prefill
    loop:
        draft = proposer.propose(request)              # -> Draft (chain or tree, see trees.Draft)
        ... the target verifies the draft in one forward ...
        proposer.accept(tokens, hidden)                # what was emitted this step

* ``input_ids`` LongTensor [1, P]: the prompt. ``next_token`` LongTensor [1, 1]: the first token the target
  emitted after it. ``hidden`` FloatTensor [1, P, D] or None: the target's tapped hidden states at the prompt
  positions (position i's output predicted input_ids[i + 1], the last one predicted ``next_token``).
* ``request`` (DraftRequest): the ``shape`` to fill (Chain / StaticTree / DynamicTree), the ``sampling``
  settings (warp q exactly like the target's p) and the engine's seeded ``generator`` for any randomness.
* ``accept(tokens, hidden)``: ``tokens`` LongTensor [1, m] are the m tokens emitted this step: the accepted
  draft tokens, then the target's bonus/correction token. ``hidden`` [1, m, D] or None are the target's
  hidden states at the m positions whose outputs produced them: the previous last token (the root) and the
  accepted draft nodes. So (hidden[:, j], tokens[:, j]) pairs a state with the token that follows it, which
  is what an EAGLE head consumes; its own KV cache grows by exactly m positions per step.
* ``hidden_layers``: None, or the target layers to tap (HF ``output_hidden_states`` indices, see
  drafttrain.targets.HiddenStateTap). When set, the engine runs the target's prefill and verification forwards
  under the tap and passes ``hidden`` (the taps concatenated on the feature axis); otherwise hidden is None.
* ``shapes``: the draft shapes the proposer can fill; the engine refuses the others up front.

A proposer keeps its own state (token history, KV cache) between these calls; ``prefill`` resets it.
Register new kinds with ``@register_proposer("name")``; build them with ``build_proposer(name, target, **kw)``.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Callable, ClassVar

import torch

from drafttrain import DrafttrainError
from drafttrain.decoding.trees import Chain, Draft, DynamicTree, StaticTree, TreeShape, children_lists, forward
from drafttrain.decoding.verify import Sampling, probabilities, sample_without_replacement


@dataclasses.dataclass
class DraftRequest:
    shape: TreeShape
    sampling: Sampling
    generator: torch.Generator | None = None


class Proposer(abc.ABC):
    name: ClassVar[str] = "?"
    hidden_layers: list[int] | None = None
    shapes: ClassVar[tuple[type, ...]] = (Chain, StaticTree, DynamicTree)

    @abc.abstractmethod
    def prefill(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, next_token: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Draft: ...

    @abc.abstractmethod
    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None: ...


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str):
    def deco(cls):
        cls.name = name
        PROPOSERS[name] = cls
        return cls

    return deco


def build_proposer(name: str, target, **kwargs) -> Proposer:
    """Build the proposer registered as ``name`` for ``target``; options are checked against its signature."""
    if name not in PROPOSERS:
        raise DrafttrainError(f"unknown proposer {name!r}; known proposers: {', '.join(sorted(PROPOSERS))}")
    factory = PROPOSERS[name]
    try:
        inspect.signature(factory).bind(target, **kwargs)
    except TypeError as err:
        raise DrafttrainError(f"proposer {name!r}: {err}") from None
    return factory(target, **kwargs)


class NoDraft(Proposer):
    """Proposes nothing: every step is one plain decoding step (the ``plain_decode`` baseline)."""

    name = "none"

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device

    def propose(self, request: DraftRequest) -> Draft:
        return Draft.empty(self.device)

    def accept(self, tokens, hidden) -> None:
        pass


@register_proposer("prompt_lookup")
class PromptLookupProposer(Proposer):
    """n-gram lookup in prompt + generated text (HF's prompt_lookup_num_tokens, Saxena 2023).

    The last n tokens (n from ``max_ngram_size`` down to ``min_ngram_size``) are searched earlier in the text,
    most recent match first; the tokens that followed a match are the draft, up to the shape's depth. For a
    chain the first match is used; for trees (static or dynamic) up to ``max_matches`` distinct continuations
    are merged into a trie, within the tree's depth and node budget (its exact branching is not followed).
    The draft is deterministic (q = one-hot), so it is lossless under sampling too.
    """

    def __init__(self, target, *, max_ngram_size: int = 3, min_ngram_size: int = 1, max_matches: int = 4):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise DrafttrainError(
                f"prompt_lookup: need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}"
            )
        if max_matches < 1:
            raise DrafttrainError(f"prompt_lookup: max_matches must be >= 1, got {max_matches}")
        self.max_ngram_size, self.min_ngram_size, self.max_matches = max_ngram_size, min_ngram_size, max_matches
        self.ids: list[int] = []

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device
        self.ids = input_ids[0].tolist() + next_token[0].tolist()

    def accept(self, tokens, hidden) -> None:
        self.ids.extend(tokens[0].tolist())

    def propose(self, request: DraftRequest) -> Draft:
        shape = request.shape
        if isinstance(shape, Chain):
            budget, branches = shape.depth, 1
        else:
            budget = len(shape) if isinstance(shape, StaticTree) else shape.total_tokens
            branches = self.max_matches
        return _trie(self._continuations(shape.depth, branches), budget, self.device)

    def _continuations(self, depth: int, branches: int) -> list[list[int]]:
        ids, found = torch.tensor(self.ids), []
        for n in range(min(self.max_ngram_size, len(self.ids) - 1), self.min_ngram_size - 1, -1):
            windows = ids[:-1].unfold(0, n, 1)  # every n-gram except the trailing one itself
            hits = (windows == ids[-n:]).all(1).nonzero()[:, 0].flip(0)
            for start in (hits + n).tolist():
                cont = self.ids[start : start + depth]
                if cont not in found:
                    found.append(cont)
                if len(found) == branches:
                    return found
        return found


def _trie(paths: list[list[int]], budget: int, device) -> Draft:
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for path in paths:
        node = -1
        for tok in path:
            if (node, tok) not in index:
                if len(tokens) == budget:
                    break
                index[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = index[(node, tok)]
    return Draft(torch.tensor([tokens], dtype=torch.long, device=device), parents)


def check_same_tokenizer(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's (vocabulary or special tokens)."""
    problems = []
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        changed = sum(1 for t in tv.keys() & dv.keys() if tv[t] != dv[t])
        problems.append(
            f"vocabularies differ ({len(tv)} vs {len(dv)} tokens; {len(tv.keys() - dv.keys())} only in the target, "
            f"{len(dv.keys() - tv.keys())} only in the draft, {changed} with different ids)"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target.tokenizer, attr, None), getattr(draft.tokenizer, attr, None)
        if a != b:
            problems.append(f"{attr} {a} vs {b}")
    a, b = sorted(target.tokenizer.all_special_tokens), sorted(draft.tokenizer.all_special_tokens)
    if a != b:
        problems.append(f"special tokens {a} vs {b}")
    if problems:
        raise DrafttrainError(
            f"draft {draft.name!r} does not use the tokenizer of target {target.name!r}: " + "; ".join(problems)
        )


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    """A separate causal LM with the target's tokenizer and its own KV cache (classic speculative decoding).

    Chains: k single-token draft forwards. Static trees: each node's children are its top-m candidates (greedy)
    or m draws without replacement from q (sampling); one draft forward per level under a tree mask. Dynamic
    trees: EAGLE-2 expansion and reranking by cumulative log-probability; candidates are the top-k, so the
    draft is deterministic (q = one-hot at verification, as in EAGLE), which keeps sampling lossless despite
    the data-dependent pruning. The draft cache holds the accepted text only: draft nodes are cropped after
    each proposal and the accepted tokens are re-fed with the next root (one batched forward).
    """

    def __init__(self, target, *, draft=None):
        from drafttrain.targets import Target, load_target

        if draft is None or draft == "":
            raise DrafttrainError(
                "the 'draft_model' proposer needs draft=<a built-in name, model folder, .gguf file or Hub id>"
            )
        self.draft = draft if isinstance(draft, Target) else load_target(str(draft))
        check_same_tokenizer(target, self.draft)
        self.model = self.draft.model
        self.vocab_size = target.vocab_size

    def prefill(self, input_ids, hidden, next_token) -> None:
        from transformers import DynamicCache

        self.ids = torch.cat([input_ids, next_token], dim=1)
        self.cache = DynamicCache(config=self.model.config)

    def accept(self, tokens, hidden) -> None:
        self.ids = torch.cat([self.ids, tokens], dim=1)

    def propose(self, request: DraftRequest) -> Draft:
        # feed what the draft has not seen yet (the accepted tokens and the root) -> logits for the root's children
        self.ctx = self.ids.shape[1]
        new = self.ids[:, self.cache.get_seq_length() :]
        root = self._logits(forward(self.model, self.cache, new, logits_to_keep=1)[0, -1])
        self.fed: list[int] = []  # tree nodes in the draft cache after the context, in order
        shape = request.shape
        if isinstance(shape, Chain):
            draft = self._chain(root, shape.depth, request)
        elif isinstance(shape, StaticTree):
            draft = self._static(root, shape, request)
        else:
            draft = self._dynamic(root, shape, request)
        self.cache.crop(-(self.cache.get_seq_length() - self.ctx))
        return draft

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Align the draft's logits to the target's vocabulary size (same tokenizer, differently padded heads)."""
        v = logits.shape[-1]
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        if v < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))
        return logits

    def _draw(self, logits: torch.Tensor, m: int, request: DraftRequest) -> tuple[list[int], torch.Tensor | None]:
        """m candidates for one node: its top-m (greedy) or m draws without replacement from q (sampling)."""
        if request.sampling.greedy:
            return torch.topk(logits, m).indices.tolist(), None
        q = probabilities(logits, request.sampling)
        return [t for t in sample_without_replacement(q, m, request.generator).tolist() if t >= 0], q

    def _feed(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
        """One draft forward over tree ``nodes`` (their ancestors already fed) -> logits [len(nodes), V]."""
        slot = {n: i for i, n in enumerate(self.fed)}
        allowed = torch.zeros(len(nodes), len(self.fed) + len(nodes), dtype=torch.bool)
        for row, n in enumerate(nodes):
            allowed[row, len(self.fed) + row] = True
            a = parents[n]
            while a >= 0:
                allowed[row, slot[a]] = True
                a = parents[a]
        device = self.ids.device
        ids = torch.tensor([[tokens[n] for n in nodes]], device=device)
        pos = torch.tensor([[self.ctx - 1 + depths[n] for n in nodes]], device=device)
        logits = forward(self.model, self.cache, ids, position_ids=pos, allowed=allowed)
        self.fed.extend(nodes)
        return self._logits(logits[0])

    def _chain(self, logits: torch.Tensor, depth: int, request: DraftRequest) -> Draft:
        tokens, qs = [], []
        for i in range(depth):
            if i:
                ids = torch.tensor([[tokens[-1]]], device=self.ids.device)
                logits = self._logits(forward(self.model, self.cache, ids)[0, -1])
            (tok,), q = self._draw(logits, 1, request)
            tokens.append(tok)
            qs.append(q)
        q = None if request.sampling.greedy else torch.stack(qs)[None]
        return Draft.chain(torch.tensor([tokens], device=self.ids.device), q)

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
        return _tree_draft(tokens, shape.parents, None if request.sampling.greedy else q_rows, self.ids.device)

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
        return _tree_draft(kept, parents, None, self.ids.device)


def _tree_draft(tokens: list, parents: list[int], q_rows: dict | None, device) -> Draft:
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
