"""Write docs/recipe-reference.md from the recipe schema itself (drafttrain/config/): every key of every section,
its type, its default and the description (or comment) the schema gives it, so the reference cannot drift from the
code (tests/test_docs.py checks the file is current and names every key).

    python scripts/tools/recipe_reference.py [--check]
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from drafttrain import config as schema

OUT = Path(__file__).resolve().parents[2] / "docs" / "recipe-reference.md"
FIELD = re.compile(r"^    (\w+)\s*:\s*[^=#]+?(?:=\s*(?P<default>[^#]*?))?\s*(?:#\s*(?P<inline>.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the sources of the class and its bases (a subclass's own comment wins): the comment
    lines right above the field, then its inline comment."""
    comments: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if issubclass(c, BaseModel) and c.__module__.startswith(schema.__name__)]):
        comments.update({k: v for k, v in own_comments(base).items() if v})
    return comments


def own_comments(cls: type) -> dict[str, str]:
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if line.startswith("    #"):
            above.append(stripped.lstrip("# "))
            continue
        match = FIELD.match(line)
        if match and not stripped.startswith(("def ", "@", "return")):
            comments[match.group(1)] = " ".join(above + ([match.group("inline")] if match.group("inline") else []))
        above = [] if not line.startswith("    #") else above
    return comments


def type_name(annotation) -> str:
    if len(_section_classes(annotation)) > 1:
        return "a section: `kind` picks which"
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or re.sub(r"drafttrain\.config\.[\w.]*?(\w+)\b(?!\.)", r"\1", str(annotation).replace("typing.", ""))
    return text.replace("|", "or").replace("NoneType", "None")


def sections() -> list[tuple[str, type[BaseModel]]]:
    """(the key a section sits under, its class), depth first from the recipe; a draft kind's section is titled
    with its kind."""
    out, seen = [], set()

    def visit(path: str, kind: str, cls: type[BaseModel]) -> None:
        title = f"{path} (kind: {kind})" if kind else path
        if title in seen:
            return
        seen.add(title)
        out.append((title, cls))
        for name, field in cls.model_fields.items():
            for sub in _section_classes(field.annotation):
                sub_kind = sub.model_fields["kind"].default if "kind" in sub.model_fields else kind
                visit(f"{path}.{name}".lstrip("."), sub_kind, sub)

    visit("", "", schema.Recipe)
    return out


def own_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ") if doc else ""


def _section_classes(annotation) -> list[type[BaseModel]]:
    """The section classes an annotation names (in unions, lists and Annotated alike)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _section_classes(arg)
    return list(dict.fromkeys(found))


def render() -> str:
    lines = ["# Recipe reference", "",
             "Every key a recipe takes, generated from the schema (`drafttrain/config/`) by",
             "`python scripts/tools/recipe_reference.py`: the type, the default and what the key does. Unknown keys and",
             "wrong types are refused before any work starts; `key.sub=value` on the command line overrides a key.", ""]
    for prefix, cls in sections():
        comments = field_comments(cls)
        title = prefix or "top level"
        lines += [f"## {title}", ""] + ([own_doc(cls), ""] if own_doc(cls) else []) + \
            ["| key | type | default | what it does |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            default = "required" if field.is_required() else repr(field.default)
            if _section_classes(field.annotation):
                default = "a section" if field.default is None or isinstance(field.default, BaseModel) else default
            what = (field.description or comments.get(name, "")).replace("|", "\\|") or "—"
            lines.append(f"| `{name}` | {type_name(field.annotation)} | {default} | {what} |")
        renamed = cls.renamed if issubclass(cls, schema.DraftConfig) else {}  # a draft section's earlier key names
        if renamed:
            lines += ["", "Earlier keys, refused naming the key that replaced them (a draft saved under them loads as "
                      "it is): " + ", ".join(f"`{old}` → `{new}`" for old, new in renamed.items()) + "."]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/recipe-reference.md is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.is_file() and OUT.read_text() == text
        print("current" if current else f"{OUT} is not current: run python scripts/tools/recipe_reference.py")
        return 0 if current else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
