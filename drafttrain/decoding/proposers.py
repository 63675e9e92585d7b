"""Draft proposers: one small interface, a registry by name, and the draft-free ones (none, prompt lookup).

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
* ``side_tokens``: whether its drafts may carry side tokens (trees.SideTokens): tokens it runs through the
  verification forward for its own use, masked apart from the draft, whose logits the engine sets on the draft's
  ``side`` before ``accept``. They need tree masks, so the engine refuses targets whose caches cannot take them.
* ``settings_class``: None, or the section of its own settings (a ``config`` Section); ``drafttrain eval``
  generates a flag per field and builds the proposer with the section's values as keywords. ``deepest(**settings)``:
  the deepest draft it fills with them (None: any), known before a target loads, so a default depth is fitted to it.

A proposer keeps its own state (token history, KV cache) between these calls; ``prefill`` resets it.
Register new kinds with ``@register_proposer("name")``, and a proposer for a kind's variant (a subclass of the kind's
proposer serving the variant's drafts) with ``@register_proposer_variant("name", VariantDrafter)``; build them with
``build_proposer(name, target, **kw)``, which picks the variant's proposer from the draft it is given.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from pathlib import Path
from typing import Callable, ClassVar

import torch

from drafttrain import DrafttrainError
from drafttrain.decoding.trees import Chain, Draft, DynamicTree, StaticTree, TreeShape
from drafttrain.drafts import Drafter, load_drafter
from drafttrain.drafts.saved import SavedDraft
from drafttrain.sampling import Sampling
from drafttrain.targets import Target


@dataclasses.dataclass
class DraftRequest:
    shape: TreeShape
    sampling: Sampling
    generator: torch.Generator | None = None


class Proposer(abc.ABC):
    name: ClassVar[str] = "?"
    hidden_layers: list[int] | None = None
    shapes: ClassVar[tuple[type, ...]] = (Chain, StaticTree, DynamicTree)
    max_depth: int | None = None  # the deepest draft it can fill (its draft's max_draft_depth), None: any
    # It serves any causal LM with the target's tokenizer (a model folder, a built-in name, a Hub id), not only a
    # drafttrain checkpoint; it may draft from a draft vocabulary (``vocab=``).
    serves_model_folders: ClassVar[bool] = False
    side_tokens: ClassVar[bool] = False  # its drafts may carry side tokens (see the module docstring)
    settings_class: ClassVar[type | None] = None  # the section its settings' flags come from (module docstring)

    @abc.abstractmethod
    def prefill(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, next_token: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Draft: ...

    @abc.abstractmethod
    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None: ...

    @classmethod
    def deepest(cls, **settings) -> int | None:
        """The deepest draft it fills when built with ``settings`` (None: any depth)."""
        return None

    def modules(self) -> list[torch.nn.Module]:
        """The torch modules it runs (the evaluator packs their CPU linear layers, drafttrain.cpu_linear)."""
        return [value for value in vars(self).values() if isinstance(value, torch.nn.Module)]

    def rank_accuracies(self, target: Target, prompts: list[torch.Tensor], max_new_tokens: int,
                        stop_token_ids: set[int]) -> list[list[float]] | None:
        """``[depth][rank]``: how often its rank-r candidate at each depth is the target's token, for proposers
        that fill static trees from ranked candidates (the input of trees.build_static_tree); None otherwise."""
        return None

    def hf_equivalent(self, depth: int) -> tuple[str, dict] | None:
        """HF ``generate``'s own version of this proposer, as (reference name, generate kwargs), for the
        evaluator's reference lines; None when HF has none."""
        return None


PROPOSERS: dict[str, Callable[..., Proposer]] = {}
# name -> (the draft class served, the proposer subclass serving it), for the variants of a kind
PROPOSER_VARIANTS: dict[str, list[tuple[type[Drafter], type[Proposer]]]] = {}


def register_proposer(name: str):
    def deco(cls):
        cls.name = name
        PROPOSERS[name] = cls
        return cls

    return deco


def register_proposer_variant(name: str, serves: type[Drafter]):
    """Register a subclass of the proposer ``name`` as the one that serves drafts of class ``serves`` (a kind's
    variant) and its subclasses; it keeps the proposer's name, so reports name the proposer as before."""
    def deco(cls):
        if not issubclass(cls, PROPOSERS[name]):
            raise DrafttrainError(f"{cls.__name__} is not a subclass of the {name!r} proposer")
        cls.name = name
        PROPOSER_VARIANTS.setdefault(name, []).append((serves, cls))
        return cls

    return deco


def model_folder_proposer() -> str:
    """The registered proposer that serves plain model folders (``drafttrain eval --draft MODEL``)."""
    return next(name for name, cls in PROPOSERS.items() if cls.serves_model_folders)


def build_proposer(name: str, target: Target, **kwargs) -> Proposer:
    """Build the proposer registered as ``name`` for ``target``; options are checked against its signature."""
    if name not in PROPOSERS:
        raise DrafttrainError(f"unknown proposer {name!r}; known proposers: {', '.join(sorted(PROPOSERS))}")
    factory = PROPOSERS[name]
    try:
        inspect.signature(factory).bind(target, **kwargs)
    except TypeError as err:
        raise DrafttrainError(f"proposer {name!r}: {err}") from None
    draft = kwargs.get("draft")
    if PROPOSER_VARIANTS.get(name) and is_trained_draft(draft):  # loaded once, here: its class picks the proposer
        kwargs["draft"] = head = trained_draft(name, target, draft)
        factory = _proposer_serving(name, type(head))
    return factory(target, **kwargs)


def is_trained_draft(draft) -> bool:
    """Whether ``draft`` is a drafttrain draft: one in memory, one opened, or a checkpoint or run folder drafttrain
    wrote."""
    return isinstance(draft, (Drafter, SavedDraft)) or (isinstance(draft, (str, Path)) and bool(draft)
                                                        and SavedDraft.find(draft) is not None)


def _proposer_serving(name: str, drafter: type[Drafter]) -> Callable[..., Proposer]:
    """The proposer registered for the most derived draft class ``drafter`` is (or derives from), else ``name``'s."""
    serving = [(served, cls) for served, cls in PROPOSER_VARIANTS.get(name, []) if issubclass(drafter, served)]
    if not serving:
        return PROPOSERS[name]
    return max(serving, key=lambda pair: len(pair[0].__mro__))[1]


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

    def __init__(self, target: Target, *, max_ngram_size: int = 3, min_ngram_size: int = 1, max_matches: int = 4):
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

    def hf_equivalent(self, depth: int) -> tuple[str, dict]:
        return "hf_prompt_lookup", {"prompt_lookup_num_tokens": depth, "max_matching_ngram_size": self.max_ngram_size}

    def accept(self, tokens, hidden) -> None:
        self.ids.extend(tokens[0].tolist())

    def propose(self, request: DraftRequest) -> Draft:
        shape = request.shape
        if isinstance(shape, Chain):
            budget, branches = shape.depth, 1
        else:
            budget = len(shape) if isinstance(shape, StaticTree) else shape.total_tokens
            branches = self.max_matches
        return trie_draft(self._continuations(shape.depth, branches), budget, self.device)

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


def trie_draft(paths: list[list[int]], budget: int, device) -> Draft:
    """Continuations merged into one deterministic draft tree, in order, shared prefixes once, up to ``budget``
    nodes."""
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


def trained_draft(proposer: str, target: Target, draft):
    """The trained draft a proposer serves: ``draft`` itself, or loaded from a checkpoint or run folder; refused
    when its kind is served by another proposer."""
    if draft is None or draft == "":
        raise DrafttrainError(f"the {proposer!r} proposer needs draft=<a checkpoint or run folder written by drafttrain>")
    head = draft if isinstance(draft, Drafter) else load_drafter(draft, target)
    if head.proposer != proposer:
        raise DrafttrainError(f"the {proposer!r} proposer does not serve {draft}: it is a {head.kind} draft, served "
                              f"by the {head.proposer!r} proposer")
    return head.eval()
