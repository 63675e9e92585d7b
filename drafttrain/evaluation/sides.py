"""The sides of an evaluation, each the same kind of thing: a ``Side`` with a role, a label and a way to generate.

* ``compared``: speculative decoding with a proposer (a registered name, a Proposer or a trained Drafter) and its
  own resolved shape. The method is the first compared side; the others are measured against the same baseline.
* ``baseline``: plain decoding through the same loop, cache and sampling code.
* ``original_target``: for a draft that adapts its target (Medusa-2's adapters), plain decoding with the
  adaptation off, so the report says how far the served target moved and the speedup against the original.
* ``hf_reference``: Hugging Face ``generate`` (plain, and HF's own version of the method's proposer).

Every side uses the one stop rule (template end-of-turn + EOS).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from drafttrain import DrafttrainError
from drafttrain.config import DecodeSettings
from drafttrain.cpu_linear import PackedLinears
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.decoding.autodepth import ShapeChoice, choose_shape
from drafttrain.drafts import Drafter
from drafttrain.evaluation.records import GenerateFn
from drafttrain.evaluation.run_info import describe_tree, jsonable
from drafttrain.targets import Target

COMPARED, BASELINE, ORIGINAL_TARGET, HF_REFERENCE = "compared", "baseline", "original_target", "hf_reference"


@dataclasses.dataclass
class Side:
    role: str  # COMPARED, BASELINE, ORIGINAL_TARGET or HF_REFERENCE
    label: str  # its name in the report
    generator: Callable[[int], GenerateFn]  # a token budget -> the side's generate function
    choice: ShapeChoice | None = None  # a compared side's proposer and resolved settings
    draft: Drafter | None = None  # a compared side's trained draft
    proposer_name: str | None = None
    proposer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def warmed_up(self) -> None:
        """After the uncounted warm-up run: an auto choice's runtime check forgets what it measured there."""
        if self.choice is not None and self.choice.guard is not None:
            self.choice.guard.restart()

    def described(self) -> dict[str, Any]:
        """What the report's config says of a compared side (its auto choices included when it had any)."""
        settings = self.choice.settings
        autos = {k: v for k, v in (("depth_auto", self.choice.depth_auto), ("tree_auto", self.choice.tree_auto),
                                   ("runtime_check", self.choice.runtime_check())) if v}
        own = {key: value for key, value in self.proposer_kwargs.items() if key != "draft"}  # a proposer's settings
        return {"label": self.label, "proposer": self.proposer_name, **autos, "depth": settings.depth,
                "tree": describe_tree(settings.tree), "min_confidence": settings.min_confidence,
                **({"proposer_settings": jsonable(own)} if own else {})}


@dataclasses.dataclass
class Compared:
    """A speculative side: a registered proposer name, a Proposer, or a trained Drafter, with its own depth and
    tree (None: the run's; "auto": chosen like the run's)."""

    proposer: str | Any
    depth: int | str | None = None
    tree: Any = None
    label: str | None = None
    proposer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def settings(self, run: DecodeSettings) -> DecodeSettings:
        """The run's settings with this side's shape: a tree given alone is as deep as the run may draft."""
        depth = self.depth if self.depth is not None else (run.depth if self.tree is None else run.deepest)
        return DecodeSettings.of(run, depth=depth, tree=run.tree if self.tree is None else self.tree)


@dataclasses.dataclass
class SideBuilder:
    """Builds the sides of one run: its target, settings, calibration prompts, stop tokens and CPU kernels."""

    target: Any
    settings: DecodeSettings
    calibration: Sequence[str]
    stop_ids: list[int]
    kernels: PackedLinears

    def compared(self, side: Compared, method: bool = False) -> Side:
        proposer, kwargs = side.proposer, dict(side.proposer_kwargs)
        draft = proposer if isinstance(proposer, Drafter) else kwargs.get("draft")
        if isinstance(proposer, Drafter):  # a trained draft: its kind says which proposer serves it
            if proposer.adapts_target and not method:
                raise DrafttrainError(f"a {proposer.kind} draft that adapts its target cannot share a run with "
                                      "other drafts (it changes the target they are measured on): evaluate it alone")
            proposer, kwargs = proposer.proposer, {**kwargs, "draft": proposer}
        built = build_proposer(proposer, self.target, **kwargs) if isinstance(proposer, str) else proposer
        self.kernels.add(*built.modules())
        name = proposer if isinstance(proposer, str) else getattr(proposer, "name", type(proposer).__name__)
        choice = choose_shape(self.target, built, side.settings(self.settings), self.calibration)
        decoder = SpeculativeDecoder(self.target, choice.proposer, choice.settings, guard=choice.guard)
        stops = set(self.stop_ids)

        def generator(budget: int) -> GenerateFn:
            def run(ids: torch.Tensor):
                out = decoder.generate(ids, budget, stop_token_ids=stops)
                return list(out.tokens), out.stats
            return run

        label = side.label or (name if method else built.name)
        return Side(COMPARED, label, generator, choice, draft if isinstance(draft, Drafter) else None, name, kwargs)

    def baseline(self) -> Side:
        settings, stops = self.settings, set(self.stop_ids)

        def generator(budget: int) -> GenerateFn:
            def run(ids: torch.Tensor):
                out = plain_decode(self.target, ids, budget, seed=settings.seed, stop_token_ids=stops,
                                   **settings.sampling)
                return list(out.tokens), out.stats
            return run

        return Side(BASELINE, "baseline", generator)

    def original_target(self, draft: Drafter, baseline: Side) -> Side:
        def generator(budget: int) -> GenerateFn:
            run = baseline.generator(budget)

            def run_original(ids: torch.Tensor):
                with draft.original_target():
                    return run(ids)
            return run_original

        return Side(ORIGINAL_TARGET, ORIGINAL_TARGET, generator)

    def hf_references(self, method: Side) -> list[Side]:
        """HF ``generate``: greedy/sampled plain decoding, plus HF's own version of the method's proposer if it has
        one (assisted generation at our draft length, and as a new user gets it)."""
        target, stops, sampling = self.target, self.stop_ids, self.settings.sampling
        depth = method.choice.settings.depth

        def reference(label: str, extra: dict | None = None, assistant_k: int | None = None) -> Side:
            return Side(HF_REFERENCE, label, lambda n: _hf_generate_fn(target, n, stops, sampling, extra, assistant_k))

        sides = [reference("hf_generate")]
        equivalent = method.choice.proposer.hf_equivalent(depth)
        if equivalent is None:
            return sides
        name, extra = equivalent
        if "assistant_model" not in extra:
            return sides + [reference(name, extra)]
        if depth:  # HF at our draft length, constant; depth 0 is plain decoding, which HF cannot be pinned to
            sides.append(reference(name, extra, assistant_k=depth))
        return sides + [reference(name + "_default", extra)]  # HF's own schedule and confidence stop


@contextlib.contextmanager
def _constant_assistant(assistant: torch.nn.Module, k: int):
    """HF reads the draft length from the *assistant's* generation_config (generate kwargs are ignored there),
    and its default schedule grows k between calls and stops drafting below a confidence threshold. Pin it to
    a constant k, as our engine drafts, for the duration of one call; the model's own config is restored."""
    original = assistant.generation_config
    pinned = copy.deepcopy(original)
    pinned.num_assistant_tokens = k
    pinned.num_assistant_tokens_schedule = "constant"
    pinned.assistant_confidence_threshold = 0.0
    assistant.generation_config = pinned
    try:
        yield
    finally:
        assistant.generation_config = original


def _hf_generate_fn(
    target: Target, budget: int, stop_ids, sampling: dict, extra: dict | None = None, assistant_k: int | None = None
) -> GenerateFn:
    model = target.model
    do_sample = sampling["temperature"] > 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=budget,
        do_sample=do_sample,
        eos_token_id=list(stop_ids),
        pad_token_id=stop_ids[0] if stop_ids else None,
        # Neutralise any sampling defaults from the model's generation_config.
        temperature=sampling["temperature"] if do_sample else None,
        top_p=sampling["top_p"] if do_sample else None,
        top_k=(sampling["top_k"] or None) if do_sample else None,
        **(extra or {}),
    )

    def run(ids: torch.Tensor):
        forwards = [0]
        # Count the target's forwards (HF exposes no acceptance counts) to estimate HF's tokens per step.
        handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        pinned = (
            _constant_assistant(kwargs["assistant_model"], assistant_k)
            if assistant_k is not None else contextlib.nullcontext()
        )
        try:
            with torch.inference_mode(), pinned:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            handle.remove()
        return out[0, ids.shape[-1]:].tolist(), {"target_forwards": forwards[0]}

    return run
