"""Lookahead decoding (Fu, Bailis, Stoica and Zhang, 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): the target drafts for itself, with no draft model and no training.

Each step is one target forward holding two branches beside the root (the last emitted token):

* the verification branch: the n-grams of the pool that start with the root (at most G), their N-1 following tokens
  merged into one tree (a shared prefix is fed once) and verified as any tree is (verify.py: greedy, and sampled
  with the draft deterministic, q one-hot, so both are lossless);
* the lookahead branch: a window of Jacobi guesses, W columns by N-1 levels, fed as side tokens (trees.SideTokens:
  never candidates, dropped from the cache after the forward). Level 0 is the root (column 0) and W-1 guesses after
  it; the token of level l in column c sits at position c + l after the root and sees columns 0..c of level 0 and
  levels 1..l of its own column: the sequence one Jacobi iteration runs. Its outputs (the argmax, also when
  sampling, as the reference implementation takes them) are the next level's guesses, and each column's tokens
  down its levels plus that output are one n-gram for the pool.

After the step the window moves one position: level 1 without its first column becomes level 0 (whose first column
is the new root), the other levels move up a level, and the outputs are the newest level, however many tokens were
accepted (the reference implementation's ALWAYS_FWD_ONE). The first N-2 steps fill the levels, from a level 0 of
prompt tokens: longer rows that shrink by a column a step, and no n-gram yet. The pool keeps, per first token, the
G n-grams seen most recently; they are verified newest first.

This follows the paper and its reference implementation (hao-ai-lab/LookaheadDecoding, lade/decoding.py, greedy and
sampled) in one forward per step; what differs:

* the G candidates are merged into a trie rather than fed apart: greedy acceptance is the same (the longest prefix
  the target agrees with), fewer tokens are fed, and sampling uses the tree rule, where the reference tries the
  candidates one after the other;
* the window's first guesses are prompt tokens drawn with a fixed seed (the reference draws them at random), so a
  run repeats;
* the pool is fed by the window alone: the reference's option to seed it with the prompt's n-grams (off by
  default) is prompt lookup's idea, measured as that proposer;
* a chain depth below N-1 (``--depth``) cuts the candidates verified; by default they are N-1 tokens long.

Targets whose caches cannot take tree masks (recurrent states, convolutions: targets.cache) refuse it, as they
refuse trees.
"""

from __future__ import annotations

import functools

import torch

from drafttrain.config.decode import LookaheadSettings
from drafttrain.decoding.proposers import DraftRequest, Proposer, register_proposer, trie_draft
from drafttrain.decoding.trees import Chain, Draft, SideTokens
from drafttrain.targets import Target

WINDOW_SEED = 0  # the first guesses' draw from the prompt: fixed, so a run repeats


@register_proposer("lookahead")
class LookaheadProposer(Proposer):
    """Lookahead decoding: Jacobi guesses of the target's own in a W x (N-1) window feed a pool of n-grams, up to G
    of which are verified each step (the module docstring). Settings: ``LookaheadSettings`` or its fields."""

    shapes = (Chain,)
    side_tokens = True
    settings_class = LookaheadSettings

    def __init__(self, target: Target, settings: LookaheadSettings | None = None, **changes):
        self.settings = LookaheadSettings.of(settings, **changes)
        self.window, self.ngram = self.settings.lookahead_window, self.settings.lookahead_ngram
        self.pool_size = self.settings.lookahead_pool
        self.max_depth = self.ngram - 1  # the engine refuses a deeper chain
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []  # level 0 without the root, then levels 1.. (filled over N-2 steps)
        self.root, self.pending = -1, None

    @classmethod
    def deepest(cls, **settings) -> int:
        return LookaheadSettings.of(**settings).lookahead_ngram - 1

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device
        prompt = input_ids[0].cpu()
        first = self.window + self.ngram - 3  # level 0 loses a column in each of the N-2 steps that fill the levels
        drawn = torch.randint(len(prompt), (first,), generator=torch.Generator().manual_seed(WINDOW_SEED))
        self.levels, self.pool, self.pending = [prompt[drawn].tolist()], {}, None
        self.root = int(next_token[0, -1])

    def propose(self, request: DraftRequest) -> Draft:
        candidates = [list(ngram[: request.shape.depth]) for ngram in reversed(self.pool.get(self.root, []))]
        tree = trie_draft(candidates, self.pool_size * self.max_depth, self.device)
        offsets, sees = _window_layout(len(self.levels[0]) + 1, len(self.levels) - 1)
        blind = torch.zeros(len(offsets), len(tree), dtype=torch.bool)  # the window sees no candidate
        tokens = torch.tensor([[t for level in self.levels for t in level]], dtype=torch.long, device=self.device)
        self.pending = SideTokens(tokens, list(offsets), torch.cat([sees[:, :1], blind, sees[:, 1:]], dim=1))
        return Draft(tree.tokens, tree.parents, side=self.pending)

    def accept(self, tokens, hidden) -> None:
        side, self.pending = self.pending, None
        if side is not None and side.logits is not None:
            self._advance(side.logits.argmax(-1).tolist())
        self.root = int(tokens[0, -1])

    def _advance(self, outputs: list[int]) -> None:
        """The window one position on, from the argmax ``outputs`` at its side tokens; once every level is filled,
        each column's n-gram goes to the pool first."""
        filled, last = len(self.levels) - 1, self.levels[-1]
        newest = outputs[len(outputs) - len(last):]  # the outputs of the last level (level 0: without the root's)
        if filled < self.ngram - 2:
            self.levels = [level[1:] for level in self.levels] + [newest if filled == 0 else newest[1:]]
            return
        keys = [self.root, *self.levels[0]]
        for column, key in enumerate(keys):
            self._remember(key, tuple(level[column] for level in self.levels[1:]) + (newest[column],))
        self.levels = [self.levels[1][1:], *self.levels[2:], newest]

    def _remember(self, key: int, ngram: tuple[int, ...]) -> None:
        """The pool's rule: per first token, the G n-grams seen most recently (one seen again is moved to newest)."""
        kept = self.pool.setdefault(key, [])
        if ngram in kept:
            kept.remove(ngram)
        kept.append(ngram)
        del kept[: max(len(kept) - self.pool_size, 0)]


@functools.lru_cache(maxsize=64)
def _window_layout(columns: int, filled: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """The window's side tokens, level 0 (without the root, columns 1..) then levels 1..``filled`` (columns 0..):
    each one's position after the root, and Bool [S, 1 + S] of what it sees of (the root, the side tokens). Cached:
    do not modify the mask."""
    slots = [(0, c) for c in range(1, columns)] + [(lv, c) for lv in range(1, filled + 1) for c in range(columns)]
    index = {slot: 1 + i for i, slot in enumerate(slots)}
    index[(0, 0)] = 0  # the root
    sees = torch.zeros(len(slots), 1 + len(slots), dtype=torch.bool)
    for row, (level, column) in enumerate(slots):
        for c in range(column + 1):  # level 0 up to its own column: the root and the guesses before it
            sees[row, index[(0, c)]] = True
        for lv in range(1, level + 1):  # its own column's levels above it, and itself
            sees[row, index[(lv, column)]] = True
    return tuple(column + level for level, column in slots), sees
