"""What every draft kind's section has: its kind, continuing a saved draft, LoRA on it, and the draft vocabulary."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from drafttrain.config.base import Section, setting_error
from drafttrain.config.shared import DraftLora


class DraftVocabConfig(Section):
    # With draft.init_from (kinds that can adopt one): the continued draft's own tokens and every token the new data
    # trains on that it lacks, whatever size and coverage say (their output rows start as the target's)
    enabled: bool = False
    size: int = Field(32000, gt=0)  # the number of draft tokens (with coverage: the most)
    # Size it by measurement instead: the fewest most-frequent tokens that cover this share of the trainable
    # tokens of the train split (rounded up to a multiple of 64), at most ``size``.
    coverage: float | None = Field(None, gt=0, le=1)


class DraftConfig(Section):
    """Base of every draft kind's section; ``kind`` picks the section (and the registry entry in drafttrain.drafts)."""

    kind: str  # the draft kind: eagle3, eagle, medusa, draft_model, dflash
    # Continue training a saved draft of this kind (a checkpoint, a run folder, an export or what `drafttrain
    # import` wrote) instead of a fresh one: its architecture and draft vocabulary are kept; of this section only
    # the settings that shape the loss (``training_settings``) may differ from it, the rest must agree or be left out.
    init_from: str | None = None
    draft_lora: DraftLora | None = None  # train LoRA adapters on a continued draft instead of all its weights
    # earlier spellings of this section's keys and their names now: a recipe that uses one is refused naming the
    # new name; a saved draft's section is read through ``upgraded``
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, values: Any) -> Any:
        if isinstance(values, dict):
            old = [key for key in cls.renamed if key in values]
            if old:
                raise setting_error("; ".join(f"{key} is now {cls.renamed[key]}" for key in old))
        return values

    @model_validator(mode="after")
    def _lora_continues(self) -> "DraftConfig":
        if self.draft_lora is not None and self.init_from is None and not self.builds_with_lora:
            raise ValueError("draft_lora adapts a trained draft through low-rank adapters: name it in draft.init_from "
                             "(on a fresh draft they would train around frozen random weights)")
        return self

    @classmethod
    def upgraded(cls, saved: dict[str, Any]) -> dict[str, Any]:
        """A section saved by an earlier drafttrain in this section's names: a key renamed at the same level moves
        to its new name (a kind whose keys moved into a sub-section adds that)."""
        for old, new in cls.renamed.items():
            if "." not in new and old in saved:
                saved[new] = saved.pop(old)
        return saved

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> "DraftConfig":
        """The section a saved draft's config holds, whichever drafttrain wrote it."""
        return cls.model_validate(cls.upgraded(dict(saved)))

    # whether the kind's build puts ``draft_lora`` on the draft itself: a draft made of pretrained weights, which
    # adapters may adapt fresh (the others get them after a saved draft is continued)
    builds_with_lora: ClassVar[bool] = False

    def cannot_continue(self) -> str | None:
        """Why a saved draft of this section cannot be continued by draft.init_from (None: it can)."""
        return None

    @property
    def trains_target(self) -> bool:
        """Whether this draft trains part of the target (then the target must run online, inside the step)."""
        return False
