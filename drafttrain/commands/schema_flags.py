"""Command-line flags generated from a schema section's fields, so a command's flags cannot drift from the recipe
schema they fill: each flag's name, type, default and help come from its field (the help is the field's
``description``).

A generated flag left out is absent from the parsed namespace (``argparse.SUPPRESS``) and the schema fills its
default, so the validated section's ``model_fields_set`` still tells a value the user gave from a default (a command
may treat the two differently: a default depth is fitted to the draft, a given one is kept).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

NUMBER_NAMES = {int: "an integer", float: "a number"}


def flag_of(field: str) -> str:
    """The flag that fills ``field``: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class FlagExtras:
    """What the schema cannot say about a field's flag: other spellings, the word that means None on the command
    line, and a note that only makes sense there (one that names another flag)."""

    aliases: tuple[str, ...] = ()
    none_word: str | None = None
    note: str = ""


def add_schema_flags(parser: argparse.ArgumentParser | Any, model: type[BaseModel], fields: Iterable[str],
                     extras: Mapping[str, FlagExtras] | None = None) -> None:
    """A flag per field of ``model`` named in ``fields``, added to ``parser`` (or an argument group). A bool that
    is on by default gets ``--no-FIELD``, one that is off ``--FIELD``. A type no rule below covers is a TypeError
    here, so a new schema field with a new type fails when the parser is built, not when a user runs it."""
    for name in fields:
        field, extra = model.model_fields[name], (extras or {}).get(name, FlagExtras())
        is_bool = field.annotation is bool
        help_text = "; ".join(filter(None, [f"{field.description or ''} ({_default_text(field, extra)})".lstrip(),
                                            extra.note]))
        common = dict(dest=name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        if is_bool:
            on = field.default is True
            parser.add_argument(flag_of(f"no_{name}" if on else name), *extra.aliases,
                                action="store_false" if on else "store_true", **common)
        else:
            options = _value_options(name, field.annotation, extra.none_word)
            parser.add_argument(flag_of(name), *extra.aliases, **options, **common)


def given_values(args: argparse.Namespace, fields: Iterable[str]) -> dict[str, Any]:
    """The values of the generated flags the user gave (the others are the schema's to fill)."""
    return {name: getattr(args, name) for name in fields if hasattr(args, name)}


def _default_text(field: FieldInfo, extra: FlagExtras) -> str:
    if field.annotation is bool:
        return f"{'on' if field.default else 'off'} by default; this flag turns it {'off' if field.default else 'on'}"
    default = extra.none_word if field.default is None and extra.none_word else field.default
    return f"default: {default}" + (f"; {extra.none_word} means None" if extra.none_word else "")


def _members(annotation: Any) -> tuple[Any, ...]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def _value_options(name: str, annotation: Any, none_word: str | None) -> dict[str, Any]:
    """argparse's type= / choices= for a field: int, float, str (and Any: a spec the schema checks), a Literal of
    words (choices), or a union of a number with Literal words and None (its ``none_word``)."""
    members = _members(annotation)
    if members in ((str,), (Any,)):
        return {"type": str}
    literals = [m for m in members if typing.get_origin(m) is Literal]
    words = [w for m in literals for w in typing.get_args(m)]
    numbers = [m for m in members if m in NUMBER_NAMES]
    optional = type(None) in members
    if len(literals) + len(numbers) + optional < len(members) or not all(isinstance(w, str) for w in words):
        raise TypeError(f"no command-line flag type for {name}: {annotation}")
    if optional and none_word is None:
        raise TypeError(f"{name} may be None: give the word that means None on the command line (FlagExtras)")
    if len(numbers) > 1:
        raise TypeError(f"no command-line flag type for {name}: {annotation} (more than one number type)")
    if not optional and not words:
        return {"type": numbers[0]}
    if not optional and not numbers:
        return {"choices": words}
    spelled = {w: w for w in words} | ({none_word: None} if optional else {})
    number = numbers[0] if numbers else None
    return {"type": _number_or_words(number, spelled), "metavar": "|".join(["N"] * bool(number) + [*spelled])}


def _number_or_words(number: type | None, words: dict[str, Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text in words:
            return words[text]
        try:
            if number is not None:
                return number(text)
        except ValueError:
            pass
        spelled = " or ".join([NUMBER_NAMES[number]] * bool(number) + [repr(w) for w in words])
        raise argparse.ArgumentTypeError(f"expected {spelled}, got {text!r}")

    return parse
