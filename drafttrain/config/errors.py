"""Validation errors said the way a recipe or a CLI flag names the setting."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from drafttrain.config.base import SETTING_ERROR
from drafttrain.config.kinds import DRAFT_KINDS


def describe_errors(err: ValidationError, name_of: Callable[[tuple], str]) -> str:
    """One line per error, the field named as its caller knows it (``name_of(loc)``: a recipe's dotted path, a
    CLI flag); a setting's own message continues that name ("--depth (k) must be positive")."""
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc[:1] == ["draft"] and len(loc) > 1 and loc[1] in DRAFT_KINDS:
            del loc[1]  # pydantic names the union member (the kind) in the path; the recipe has no such key
        where = name_of(tuple(loc))
        msg = "unknown key (not in the schema)" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            msg = f"draft.kind must be one of {', '.join(DRAFT_KINDS)}"
        if e["type"] == SETTING_ERROR and msg.startswith(("(", "must ")):
            lines.append(f"{where} {msg}")
        elif e["type"] == SETTING_ERROR and not where:  # a rule across settings says what it is about
            lines.append(msg)
        else:
            lines.append(f"{where or '(top level)'}: {msg}")
    return "\n".join(lines)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = describe_errors(err, lambda loc: ".".join(str(p) for p in loc)).splitlines()
    return "\n".join([f"invalid recipe {source}:", *(f"  {line}" for line in lines)])
