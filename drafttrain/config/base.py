"""What every recipe section is: a strict pydantic model that names the packages it needs."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

SETTING_ERROR = "setting"  # pydantic error type whose message continues the setting's name ("--depth (k) must ...")


class Section(BaseModel):
    # Unknown keys are errors, and so are inf / nan anywhere: a number that can only fail later fails now.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # the packages a section needs whenever it is present in a recipe (peft for a LoRA section)
    needs: ClassVar[tuple[str, ...]] = ()
    # of a draft's settings, those a continued draft may change: they shape the training loss, not the weights
    training_settings: ClassVar[frozenset[str]] = frozenset()

    def packages(self) -> list[tuple[str, str]]:
        """(field, module) for each package this section needs as set ("" names the section itself)."""
        return [("", module) for module in self.needs]


def needed_packages(section: Section, path: str = "") -> list[tuple[str, str]]:
    """(recipe field, module) for every package a recipe (or any section) needs as set, nested sections included."""
    out = [(".".join(p for p in (path, field) if p), module) for field, module in section.packages()]
    for name in type(section).model_fields:
        value = getattr(section, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, child in items:
            if isinstance(child, Section):
                where = ".".join(p for p in (path, name, None if index is None else str(index)) if p)
                out += needed_packages(child, where)
    return out


def setting_error(message: str) -> PydanticCustomError:
    """A validation error whose message continues the setting's name (a recipe path or a CLI flag)."""
    return PydanticCustomError(SETTING_ERROR, message)


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise setting_error(f"must be positive, got {value!r}")
    return value
