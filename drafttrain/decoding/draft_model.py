"""The ``draft_model`` proposer: a separate causal LM with the target's tokenizer and its own KV cache (classic
speculative decoding, and the proposer of drafttrain draft models).

The draft's cache holds the accepted text only: drafted nodes are cropped after each proposal, and the accepted
tokens are fed with the next root in one batched forward. Chains and trees are drafted by
drafttrain.decoding.expand.TreeDrafter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafttrain import DrafttrainError
from drafttrain.data.vocab import draft_ids, read_vocab_mapping, scatter_to_vocab
from drafttrain.decoding.expand import TreeDrafter
from drafttrain.decoding.proposers import is_trained_draft, register_proposer, trained_draft
from drafttrain.decoding.trees import feed_mask
from drafttrain.targets import Target, TargetCache, check_same_tokenizer, load_target
from drafttrain.targets.outputs import plain_lm_head


@register_proposer("draft_model")
class DraftModelProposer(TreeDrafter):
    serves_model_folders = True
    """``vocab``: draft only from these target token ids (a tensor, or a draft-vocab .safetensors file with
    d2t/t2d): the draft's logits are computed for those rows of its lm_head alone, which is most of a small draft's
    cost with a large vocabulary. A drafttrain draft model brings its own (``serving_vocab``); ``False``: the
    whole vocabulary even then. Lossless either way: the target verifies every token."""

    def __init__(self, target: Target, *, draft=None, vocab=None):
        if draft is None or draft == "":
            raise DrafttrainError(
                "the 'draft_model' proposer needs draft=<a built-in name, model folder, .gguf file or Hub id>"
            )

        if is_trained_draft(draft):
            # a drafttrain draft model (being trained, or a checkpoint or run): it speaks the target's tokens
            distilled = trained_draft(self.name, target, draft)
            self.draft = Target("draft_model", distilled.student, target.tokenizer)
            vocab = distilled.serving_vocab if vocab is None else vocab
        else:
            self.draft = draft if isinstance(draft, Target) else load_target(str(draft))
            check_same_tokenizer(target, self.draft)
        self.model = self.draft.model
        self.vocab_size = target.vocab_size
        self.rows, self.head = self._draft_vocab_head(vocab)

    def _draft_vocab_head(self, vocab) -> tuple[torch.Tensor | None, torch.nn.Linear | None]:
        if vocab is None or vocab is False:
            return None, None
        if isinstance(vocab, (str, Path)):
            vocab = draft_ids(read_vocab_mapping(vocab, self.vocab_size)[0])
        rows = torch.as_tensor(vocab, dtype=torch.long, device=self.model.device)
        weight = plain_lm_head(self.model, rows).weight.detach()[rows].contiguous()
        # a module, not a bare matrix, so that the evaluator's CPU kernel packing reaches it (drafttrain.cpu_linear)
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        return rows, head

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.device = input_ids.device
        self.ids = torch.cat([input_ids, next_token], dim=1)
        self.cache = TargetCache(self.model)

    def accept(self, tokens, hidden) -> None:
        self.ids = torch.cat([self.ids, tokens], dim=1)

    def hf_equivalent(self, depth: int) -> tuple[str, dict]:
        return "hf_assisted", {"assistant_model": self.model}  # HF's assisted generation with the same draft

    def _root_logits(self) -> torch.Tensor:
        # feed what the draft has not seen yet (the accepted tokens and the root) -> logits for the root's children
        self.ctx = self.ids.shape[1]
        # A proposal repeated without an accept in between (autodepth times proposals) finds the root already in
        # the cache: re-feed it, since its logits are what the proposal starts from.
        start = min(self.cache.length, self.ctx - 1)
        self.cache.keep(start, [])
        new = self.ids[:, start:]
        return self._aligned(self.cache.forward(new, logits_to_keep=1, head=self.head)[0, -1])

    def _feed(self, nodes, tokens, parents, depths) -> torch.Tensor:
        ids = torch.tensor([[tokens[n] for n in nodes]], device=self.device)
        allowed = feed_mask(parents, self.fed, nodes)
        if bool(allowed.all()):  # a chain: plain causal attention at the next positions, no mask to build
            logits = self.cache.forward(ids, head=self.head)
        else:
            pos = torch.tensor([[self.ctx - 1 + depths[n] for n in nodes]], device=self.device)
            logits = self.cache.forward(ids, position_ids=pos, allowed=allowed, head=self.head)
        self.fed.extend(nodes)
        return self._aligned(logits[0])

    def _forget_draft(self) -> None:
        self.cache.keep(self.ctx, [])

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary size (same tokenizer, differently padded heads; -inf
        outside a draft vocabulary)."""
        if self.rows is not None:
            return scatter_to_vocab(logits, self.rows, self.vocab_size)
        v = logits.shape[-1]
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        if v < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))
        return logits
