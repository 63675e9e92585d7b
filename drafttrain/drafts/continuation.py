"""A run's draft section resolved once: the recipe's, or under ``draft.init_from`` the saved draft's with the
recipe's training settings (``ResolvedDraft``: the section and the saved draft, opened once and passed on to the
checks, the plan, prepare and the trainer), and the draft a run starts from (``start_drafter``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from pydantic import ValidationError

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig, Section
from drafttrain.data.vocab import draft_vocab_for
from drafttrain.drafts.base import Drafter
from drafttrain.drafts.lora import add_draft_lora
from drafttrain.drafts.registry import build_drafter, drafter_for
from drafttrain.drafts.saved import SavedDraft, _params_to, load_drafter
from drafttrain.runfolder import RunFolder
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds


@dataclasses.dataclass(frozen=True)
class ResolvedDraft:
    """A run's draft: the recipe's section, the section the run trains with (under ``init_from``, the saved draft's
    with the recipe's training settings) and the saved draft itself, found and read once."""

    recipe: DraftConfig
    section: DraftConfig
    saved: SavedDraft | None = None


def resolve_draft(config: DraftConfig | ResolvedDraft) -> ResolvedDraft:
    """A draft section resolved (its ``init_from`` opened and checked against it); one resolved already, as it is.
    Read from configs alone: a recipe is checked before any model loads."""
    if isinstance(config, ResolvedDraft):
        return config
    if config.init_from is None:
        return ResolvedDraft(config, config)
    saved = SavedDraft.open(config.init_from)
    if saved.kind.kind != config.kind:
        raise DrafttrainError(f"draft.init_from {config.init_from} holds a {saved.kind.kind} draft; the recipe trains "
                              f"a {config.kind} draft")
    return ResolvedDraft(config, continued_config(saved.section(), config, config.init_from), saved)


def resolved_section(config: DraftConfig | ResolvedDraft) -> DraftConfig:
    """The draft section a run trains with (see :func:`resolve_draft`)."""
    return resolve_draft(config).section


def start_drafter(config: DraftConfig | ResolvedDraft, target: Target, run: RunFolder | None = None,
                  new_vocabulary: bool = False) -> Drafter:
    """The draft a training run starts from: a fresh one of the recipe's kind, or the saved one ``init_from``
    names, continued (over the run's own draft vocabulary when ``new_vocabulary``: draft_vocab.enabled); with
    ``draft_lora``, wrapped in LoRA adapters that alone train."""
    draft = resolve_draft(config)
    if draft.saved is None:
        drafter = build_drafter(draft.recipe, target, run)
    else:
        drafter = continued_drafter(draft, target)
        if new_vocabulary:
            drafter.adopt_vocabulary(*draft_vocab_for(None, run, target.vocab_size))
    if draft.recipe.draft_lora is not None and not draft.recipe.builds_with_lora:
        add_draft_lora(drafter, draft.recipe.draft_lora)
    return drafter


def continued_drafter(config: DraftConfig | ResolvedDraft, target: Target) -> Drafter:
    """The saved draft at ``init_from`` (checked as every loaded draft is: its files, its tokenizer, its weights),
    given the recipe's training settings."""
    draft = resolve_draft(config)
    # as saved, then in fp32 as a fresh draft is built: a draft in the target's half type would train without fp32
    # master weights (updates below bf16's resolution lost) and its LoRA adapters would be made in that type too
    drafter = load_drafter(draft.saved, target, as_saved=True)
    _params_to(drafter, torch.float32)
    drafter.config = draft.section
    drafter.continued_from = drafter.loaded_from
    return drafter.train()


def run_target_needs(config: DraftConfig | ResolvedDraft, target: Target) -> TargetNeeds:
    """What a run of this draft section reads from ``target`` (the section resolved as the run trains it)."""
    section = resolved_section(config)
    return drafter_for(section).target_needs(section, target)


def kept_target_layers(config: DraftConfig | ResolvedDraft) -> int:
    """The target's last decoder layers a run holds whole for its draft to start from (a fresh draft's
    ``start_layers``; a continued draft starts from its own weights, so none)."""
    recipe = config.recipe if isinstance(config, ResolvedDraft) else config
    return drafter_for(recipe).start_layers(recipe) if recipe.init_from is None else 0


def check_vocabulary_choice(config: DraftConfig | ResolvedDraft, new_vocabulary: bool) -> None:
    """A continued draft drafts over a vocabulary chosen on the new data only when its kind can adopt one."""
    recipe = config.recipe if isinstance(config, ResolvedDraft) else config
    if recipe.init_from is not None and new_vocabulary and not drafter_for(recipe).adopts_vocabulary:
        raise DrafttrainError(f"draft.init_from: a {recipe.kind} draft keeps the draft vocabulary it was trained "
                              "with; set draft_vocab.enabled: false")


def continued_config(saved: DraftConfig, recipe: DraftConfig, where: str) -> DraftConfig:
    """The saved draft's section with the recipe's training settings (those it sets); any other setting the recipe
    gives must equal the saved draft's, since the weights were made with it."""
    cannot = saved.cannot_continue()
    if cannot:
        raise DrafttrainError(f"draft.init_from {where}: {cannot}")
    clashes, changes = _recipe_changes(saved, recipe, "draft.", skip={"kind", "init_from", "draft_lora"})
    if clashes:
        raise DrafttrainError(f"draft.init_from keeps the architecture of the draft at {where}, which the recipe "
                              "contradicts: " + "; ".join(f"{name} is {mine!r} in the recipe, {theirs!r} in the draft"
                                                          for name, mine, theirs in clashes)
                              + " (leave these out of the recipe)")
    merged = {**_merged(saved.model_dump(), changes), "init_from": recipe.init_from,
              "draft_lora": recipe.draft_lora.model_dump() if recipe.draft_lora else None}
    try:
        return type(saved).model_validate(merged)
    except ValidationError as err:
        raise DrafttrainError(f"draft.init_from {where}: the recipe's settings do not fit the saved draft: "
                              f"{err.errors()[0]['msg']}") from None


def _recipe_changes(saved: Section, recipe: Section, prefix: str, skip: frozenset[str] | set[str] = frozenset()
                    ) -> tuple[list[tuple[str, Any, Any]], dict[str, Any]]:
    """What the recipe sets against a saved section: (dotted name, recipe's, saved) for each setting of the weights'
    that differs, and the training settings it gives, sub-sections (``parallel``) compared setting by setting."""
    clashes, changes = [], {}
    for name in sorted(recipe.model_fields_set - skip):
        mine, theirs = getattr(recipe, name), getattr(saved, name)
        if name in recipe.training_settings:
            changes[name] = mine
        elif isinstance(mine, Section) and type(mine) is type(theirs):
            inner_clashes, inner = _recipe_changes(theirs, mine, f"{prefix}{name}.")
            clashes += inner_clashes
            if inner:
                changes[name] = _SubChanges(inner)
        elif mine != theirs:
            clashes.append((f"{prefix}{name}", mine, theirs))
    return clashes, changes


class _SubChanges(dict):
    """A sub-section's changes, merged into the saved sub-section rather than replacing it."""


def _merged(saved: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    return {**saved, **{name: _merged(saved[name], value) if isinstance(value, _SubChanges) else value
                        for name, value in changes.items()}}
