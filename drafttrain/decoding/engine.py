"""The speculative decoding loop (batch size 1, tensors kept batch-shaped).

State between steps: the target's KV cache holds every token except the last emitted one, the *root*. A step
feeds [root, draft nodes..., side tokens...] in one forward (a tree gets a 4D ancestor mask and depth-based
positions; a proposer's side tokens see what it says and are seen by no node), verifies (verify.py), keeps the cache
entries of the root and the accepted nodes, and emits accepted + one target token; the side tokens' logits go back
to the proposer. Invariant after every step: cache length == prompt length + emitted tokens - 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from drafttrain import DrafttrainError
from drafttrain.config import DecodeSettings
from drafttrain.decoding.guard import Cycle, RuntimeGuard
from drafttrain.decoding.proposers import DraftRequest, NoDraft, Proposer, build_proposer
from drafttrain.decoding.trees import Chain, Draft, as_shape, verification_layout
from drafttrain.decoding.verify import (
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from drafttrain.sampling import Sampling, probabilities
from drafttrain.targets import HiddenStateTap, Target, TargetCache, synchronize
from drafttrain.targets.cache import tree_refusal


@dataclasses.dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0  # verification forwards (prefill excluded)
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0  # the whole generate call, prefill included
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)  # draft tokens accepted (bonus excluded)
    drafted_per_step: list[int] = dataclasses.field(default_factory=list)  # chain length / deepest tree path
    fed_per_step: list[int] = dataclasses.field(default_factory=list)  # tokens fed: root + nodes + side tokens
    # per step: the token after the accepted draft tokens replaced draft tokens the target refused (the accepted
    # path's last node, or the root, had children), rather than extending a draft accepted to its end
    rejected_per_step: list[bool] = dataclasses.field(default_factory=list)
    position_drafted: list[int] = dataclasses.field(default_factory=list)  # [i]: steps with a depth-(i+1) token
    position_accepted: list[int] = dataclasses.field(default_factory=list)  # [i]: steps accepting depth i+1
    proposer_time_s: float = 0.0  # proposer prefill + propose + accept
    verify_time_s: float = 0.0  # verification forwards + acceptance + cache update
    rollback_time_s: float = 0.0  # of verify_time_s: the cache's rollback to the accepted tokens (targets.cache)
    cycle_s: list[float] = dataclasses.field(default_factory=list)  # per step: draft + verify + the proposer's accept


@dataclasses.dataclass
class DecodeOutput:
    tokens: list[int]  # new tokens only
    stats: DecodeStats


class _LazyRows:
    """Per-row target argmax / warped probabilities, computed on first use: tree verification visits only the
    rows along the accepted path (and its rejected siblings' parent), not all N+1."""

    def __init__(self, logits: torch.Tensor, fn):
        self.logits, self.fn, self.rows = logits, fn, {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            self.rows[i] = self.fn(self.logits[i])
        return self.rows[i]


@contextlib.contextmanager
def _timed(stats: DecodeStats, field: str):
    start = time.perf_counter()
    yield
    setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``proposer`` (a Proposer or a registered name).

    tree: "chain" (up to ``depth`` tokens; ``min_confidence`` stops a drafter early when unsure, see trees.Chain),
    a list of Medusa-style paths (static tree) or a DynamicTree (EAGLE-2).
    temperature 0 is greedy (bit-identical to plain greedy decoding); otherwise exactly lossless sampling from
    the target's distribution warped by temperature / top_k / top_p, seeded by ``seed`` per generate call.
    """

    def __init__(self, target: Target, proposer: Proposer | str, settings: DecodeSettings | None = None, *,
                 guard: RuntimeGuard | None = None, **changes):
        settings = DecodeSettings.of(settings, **changes)
        if settings.depth == "auto" or settings.tree == "auto":
            raise DrafttrainError("the engine decodes a chosen shape: resolve depth or tree 'auto' first "
                                  "(drafttrain.decoding.autodepth.choose_shape)")
        self.target, self.model, self.settings = target, target.model, settings
        self.proposer = build_proposer(proposer, target) if isinstance(proposer, str) else proposer
        self.shape = as_shape(settings.tree, settings.depth, settings.min_confidence)
        self.sampling = Sampling(**settings.sampling)
        self.seed = settings.seed
        if not isinstance(self.shape, self.proposer.shapes):
            raise DrafttrainError(
                f"proposer {self.proposer.name!r} cannot fill a {type(self.shape).__name__} draft "
                f"(it supports: {', '.join(s.__name__ for s in self.proposer.shapes)})"
            )
        side = self.proposer.side_tokens
        if not isinstance(self.shape, Chain) or side:  # tree masks, which a recurrent target refuses (targets.cache)
            why = (f"run the {self.proposer.name} proposer's own tokens beside its draft", "Use another proposer")
            refusal = tree_refusal(self.model, *why) if side else tree_refusal(self.model)
            if refusal:
                raise DrafttrainError(refusal)
        limit = self.proposer.max_depth
        if limit is not None and self.shape.depth > limit:
            raise DrafttrainError(f"a draft of depth {self.shape.depth} is deeper than proposer "
                                  f"{self.proposer.name!r} can fill ({limit}: the deepest its draft proposes)")
        self.guard = guard  # an auto choice's runtime check: it picks each cycle's shape (None: always self.shape)
        self.cache = None  # the target's KV cache after the last generate (for inspection)
        self.tap = None

    def generate(self, input_ids, max_new_tokens: int, stop_token_ids: set[int] | None = None) -> DecodeOutput:
        ids = self._prompt(input_ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise DrafttrainError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        stop, stats, start = set(stop_token_ids or ()), DecodeStats(), time.perf_counter()
        if max_new_tokens == 0:
            return DecodeOutput([], stats)
        generator = torch.Generator(device=ids.device).manual_seed(self.seed)
        request = DraftRequest(self.shape, self.sampling, generator)
        with torch.inference_mode(), self._tap() as tap:
            self.tap = tap
            with _timed(stats, "prefill_time_s"):
                logits, hidden = self._prefill(ids)
                out = [self._first_token(logits, generator)]
            fed = self.guard is None or self.guard.start_prompt()  # whether the proposer follows this prompt
            if fed:
                with _timed(stats, "proposer_time_s"):
                    self.proposer.prefill(ids, hidden, self._tensor([out]))
            while len(out) < max_new_tokens and out[-1] not in stop:
                request.shape = self.shape if self.guard is None else self.guard.next_shape()
                emitted, cycle = self._cycle(request, out[-1], generator, stats, fed)
                if self.guard is not None:
                    self.guard.observe(request.shape, cycle)
                    fed = fed and self.guard.shape is not None  # a fallback to plain decoding stops feeding it
                for tok in emitted:
                    out.append(tok)
                    if tok in stop or len(out) == max_new_tokens:
                        break
            self.cache.keep(ids.shape[1] + len(out) - 1, [])  # drop a truncated step's tail
        stats.new_tokens, stats.wall_time_s = len(out), time.perf_counter() - start
        return DecodeOutput(out, stats)

    def _cycle(self, request: DraftRequest, root: int, generator, stats: DecodeStats, fed: bool):
        """Draft (nothing when ``request.shape`` is None: a plain step), verify, and let the proposer consume the
        emitted tokens (when it follows this prompt). Returns the emitted tokens and the cycle's timings."""
        # each phase waits for the kernels it queued, so that on a GPU its time is not charged to the next phase
        device = self.target.device
        start = time.perf_counter()
        draft = Draft.empty(device) if request.shape is None else self.proposer.propose(request)
        synchronize(device)
        drafted = time.perf_counter()
        emitted, hidden = self._verify(draft, root, generator, stats)
        verified = time.perf_counter()
        if fed:
            self.proposer.accept(self._tensor([emitted]), hidden)
            synchronize(device)
        end = time.perf_counter()
        stats.proposer_time_s += (drafted - start) + (end - verified)
        stats.verify_time_s += verified - drafted
        stats.cycle_s.append(end - start)
        return emitted, Cycle(tokens=len(emitted), seconds=end - start, verify_s=verified - drafted,
                              drafted=draft.depth)

    def _prefill(self, ids: torch.Tensor):
        self.cache = TargetCache(self.model)
        return self._forward(ids, logits_to_keep=1)

    def _first_token(self, logits: torch.Tensor, generator) -> int:
        _, nxt = self._accept(Draft.empty(logits.device), logits[0, -1:], generator)
        return nxt

    def _verify(self, draft: Draft, root: int, generator, stats: DecodeStats):
        """One target forward over [root, draft..., side tokens...]; returns the emitted tokens and the accepted
        positions' hidden states (root first) for the proposer, and hands the side tokens their logits."""
        prefix, nodes = self.cache.length, len(draft) + 1
        fed = [draft.tokens] + ([] if draft.side is None else [draft.side.tokens])
        inputs = torch.cat([self._tensor([[root]]), *(t.to(self.target.device) for t in fed)], dim=1)
        positions, allowed = verification_layout(draft, prefix, inputs.device)
        logits, hidden = self._forward(inputs, position_ids=positions, allowed=allowed)
        if draft.side is not None:
            draft.side.logits = logits[0, nodes:]
        path, nxt = self._accept(draft, logits[0, :nodes], generator)
        keep = [0] + [1 + node for node in path]
        started = time.perf_counter()
        self.cache.keep(prefix, keep)
        synchronize(self.target.device)
        stats.rollback_time_s += time.perf_counter() - started
        self._record(stats, draft, path)
        emitted = draft.tokens[0, path].tolist() + [nxt]
        return emitted, None if hidden is None else hidden[:, keep]

    def _accept(self, draft: Draft, logits: torch.Tensor, generator) -> tuple[list[int], int]:
        """Verify ``draft`` against the target's logits [N+1, V] -> (accepted node indices, next token)."""
        k = len(draft)
        if self.sampling.greedy:
            if draft.is_chain:
                n, nxt = verify_chain_greedy(draft.tokens, logits.argmax(-1)[None])
                return list(range(int(n))), int(nxt)
            return verify_tree_greedy(draft.tokens[0], draft.parents, _LazyRows(logits, torch.argmax))
        if draft.is_chain:
            p = probabilities(logits, self.sampling)[None]
            q = None if draft.q is None else draft.q[:, :k]
            n, nxt = verify_chain(draft.tokens, p, q, generator)
            return list(range(int(n))), int(nxt)
        q = None if draft.q is None else draft.q[0]
        p = _LazyRows(logits, lambda row: probabilities(row, self.sampling))
        return verify_tree(draft.tokens[0], draft.parents, p, q, generator)

    def _forward(self, input_ids: torch.Tensor, **kwargs):
        logits = self.cache.forward(input_ids, **kwargs)
        if self.tap is None:
            return logits, None
        hidden = self.tap.stacked()
        self.tap.clear()
        return logits, hidden

    @staticmethod
    def _record(stats: DecodeStats, draft: Draft, path: list[int]) -> None:
        accepted = len(path)
        stats.target_forwards += 1
        stats.accepted_per_step.append(accepted)
        stats.drafted_per_step.append(draft.depth)
        stats.fed_per_step.append(draft.width)
        stats.rejected_per_step.append((path[-1] if path else -1) in draft.parents)
        for counts, upto in ((stats.position_drafted, draft.depth), (stats.position_accepted, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1
        if len(stats.position_accepted) < len(stats.position_drafted):
            stats.position_accepted.extend([0] * (len(stats.position_drafted) - len(stats.position_accepted)))

    def _tap(self):
        layers = self.proposer.hidden_layers
        return HiddenStateTap(self.model, layers) if layers else contextlib.nullcontext()

    def _tensor(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.target.device)

    def _prompt(self, input_ids) -> torch.Tensor:
        if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
            input_ids = input_ids["input_ids"]
        try:
            ids = torch.as_tensor(input_ids, dtype=torch.long).to(self.target.device)
        except (TypeError, ValueError) as err:
            raise DrafttrainError(f"input_ids must be token ids (list of ints or LongTensor): {err}") from None
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise DrafttrainError(
                f"input_ids must be one sequence (list of ints or [1, n] tensor), got shape {tuple(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise DrafttrainError("the prompt is empty: give at least one token")
        return ids


def plain_decode(
    target: Target,
    input_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: set[int] | None = None,
) -> DecodeOutput:
    """The baseline: one target forward per token through the same loop, cache and sampling code (an empty
    draft every step). target_forwards = decoding steps; accepted_per_step is all zeros."""
    decoder = SpeculativeDecoder(
        target, NoDraft(), depth=1, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    return decoder.generate(input_ids, max_new_tokens, stop_token_ids)
