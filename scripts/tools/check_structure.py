"""The house rules that an AST scan can check, measured on drafttrain/ (issue "Room for the next kinds"):

* no import circles and no upward imports between the pipeline's layers;
* no function over 80 lines, and ``evaluate()`` at most 60;
* no draft kind or variant named (as a string or by its class) outside its own modules (the kind's and its variants'
  in drafts/, their proposers' modules, the kind's recipe section in config/kinds/), and the lists of built-in kinds
  (config/kinds/__init__.py, drafts/registry.py);
* no branch in a kind's own class on what selects one of its variants (the attributes the variant's ``serves``
  reads), and no ``getattr(..., "parallel")``: a variant is a subclass, never a flag;
* no side of an evaluation told apart by a string prefix;
* how many imports sit inside function bodies (each should be heavy and on one path, with a comment saying so);
  and the largest classes and modules, in lines.

    python scripts/tools/check_structure.py          # prints the findings; exit 1 when a rule is broken

tests/test_architecture.py runs the same checks, so CI enforces them.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "drafttrain"
LAYERS = ["foundation", "engines", "data", "targets", "sources", "drafts", "training", "decoding", "evaluation", "export", "serving", "runs", "commands",
          "main"]
FOUNDATION = {"drafttrain", "drafttrain.packages", "drafttrain.userfiles", "drafttrain.runfolder", "drafttrain.sampling", "drafttrain.cpu_linear",
              "drafttrain.progress"}
FOUNDATION_PACKAGES = ("drafttrain.config",)  # every module of these packages is foundation
MAX_FUNCTION_LINES = 80
MAX_EVALUATE_LINES = 60
SIDE_MODULES = {"drafttrain.evaluation.evaluate", "drafttrain.evaluation.sides", "drafttrain.evaluation.records"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}


def layer_of(module: str) -> str:
    if module in FOUNDATION or any(module == p or module.startswith(p + ".") for p in FOUNDATION_PACKAGES):
        return "foundation"
    if module == "drafttrain.__main__":
        return "main"
    part = module.split(".")[1]
    if part not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS (or it to FOUNDATION)")
    return part


def _resolve(name: str) -> str | None:
    """The drafttrain module an imported name means (a submodule when it is one), or None for others."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every drafttrain module ``module`` imports: at module level, inside functions, relative, ``from pkg import
    submodule``, and module names handed to importlib as strings."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("drafttrain."):
            found.add(node.value)
    resolved = {_resolve(name) for name in found if name.split(".")[0] == "drafttrain"}
    return {m for m in resolved if m and m != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def upward_imports() -> list[str]:
    return [f"{module} ({layer_of(module)}) imports {other} ({layer_of(other)})"
            for module, others in GRAPH.items() for other in sorted(others)
            if LAYERS.index(layer_of(other)) > LAYERS.index(layer_of(module))]


def import_circles() -> list[list[str]]:
    circles = []
    for start in sorted(MODULES):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH[node]:
                if nxt == start:
                    circles.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return circles


def functions() -> list[tuple[str, str, int]]:
    """(module, qualified name, lines) of every function and method."""
    found = []
    for module, tree in TREES.items():
        def visit(node, prefix=""):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((module, prefix + child.name, child.end_lineno - child.lineno + 1))
                    visit(child, prefix + child.name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
        visit(tree)
    return found


def long_functions() -> list[str]:
    too_long = [f"{m}.{name}: {n} lines" for m, name, n in functions() if n > MAX_FUNCTION_LINES]
    too_long += [f"{m}.{name}: {n} lines (at most {MAX_EVALUATE_LINES})" for m, name, n in functions()
                 if m == "drafttrain.evaluation.evaluate" and name == "evaluate" and n > MAX_EVALUATE_LINES]
    return too_long


@functools.cache
def registry():
    sys.path.insert(0, str(PACKAGE.parent))
    from drafttrain.decoding.proposers import PROPOSER_VARIANTS, PROPOSERS
    from drafttrain.drafts.registry import KINDS, VARIANTS

    return KINDS, VARIANTS, PROPOSERS, PROPOSER_VARIANTS


def kind_names() -> dict[str, set[str]]:
    """Each registered kind's name -> the names that mean it (its kind string, its class's and its variants')."""
    kinds, variants, _, _ = registry()
    return {kind: {kind, cls.__name__, *(v.__name__ for v in variants.get(kind, []))} for kind, cls in kinds.items()}


@functools.cache
def own_modules(kind: str) -> frozenset[str]:
    """The modules that are a kind's own: its class's, its variants' and their bases' in drafttrain (a head shared
    by related kinds), its and its variants' codecs', and those of its proposer and the proposer's variants (which
    are registered by its name)."""
    from drafttrain.drafts.codecs import codecs_of, readers_of

    kinds, variants, proposers, proposer_variants = registry()
    own = [kinds[kind], *variants.get(kind, [])]
    classes = [base for cls in own for base in cls.__mro__]
    name = kinds[kind].proposer
    served = [proposers[name], *(p for _, p in proposer_variants.get(name, []))]
    formats = [type(c) for cls in own for c in (*codecs_of(cls).values(), *readers_of(cls))]
    sections = [cls.config_class for cls in own]
    return frozenset({cls.__module__ for cls in [*classes, *sections]} - {"drafttrain.drafts.base"}
                     | {p.__module__ for p in served}
                     | {c.__module__ for c in formats} - {"drafttrain.drafts.codecs"})


def may_name_kinds(module: str, kind: str) -> bool:
    return module in own_modules(kind) | {"drafttrain.config.kinds", "drafttrain.drafts.registry"}


def named_kinds() -> list[str]:
    """String constants equal to a kind's name, and identifiers or attributes equal to its or its variants' class
    names."""
    found = []
    for kind, names in kind_names().items():
        for module, tree in TREES.items():
            if may_name_kinds(module, kind):
                continue
            for node in ast.walk(tree):
                value = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else
                         node.id if isinstance(node, ast.Name) else
                         node.attr if isinstance(node, ast.Attribute) else
                         next((a.name for a in node.names if a.name in names), None)
                         if isinstance(node, ast.ImportFrom) else None)
                if value in names:
                    found.append(f"{module}:{node.lineno} names kind {kind!r} ({value})")
    return found


def _read_attributes(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _class_node(cls) -> ast.ClassDef:
    tree = TREES[cls.__module__]
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)


def variant_flags() -> list[str]:
    """A kind's own class (or its proposer) testing what selects one of its variants, and getattr(..., "parallel")."""
    kinds, variants, proposers, _ = registry()
    found = []
    for kind, cls in kinds.items():
        for variant in variants.get(kind, []):
            serves = next(f for f in _class_node(variant).body if isinstance(f, ast.FunctionDef) and f.name == "serves")
            selectors = _read_attributes(serves) - {"config"}
            for owner in (cls, proposers[cls.proposer]):
                for node in ast.walk(_class_node(owner)):
                    if isinstance(node, (ast.If, ast.IfExp, ast.While)) and _read_attributes(node.test) & selectors:
                        found.append(f"{owner.__module__}:{node.lineno} tests {sorted(_read_attributes(node.test) & selectors)}, "
                                     f"which selects {variant.__name__}")
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == "parallel"):
                found.append(f"{module}:{node.lineno} asks getattr(..., 'parallel')")
    return found


def largest_classes(count: int = 3) -> list[str]:
    sizes = [(n.end_lineno - n.lineno + 1, f"{module}.{n.name}") for module, tree in TREES.items()
             for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return [f"{name} ({lines})" for lines, name in sorted(sizes, reverse=True)[:count]]


def largest_modules(count: int = 3) -> list[str]:
    sizes = [(len(path.read_text().splitlines()), module) for module, path in MODULES.items()]
    return [f"{name} ({lines})" for lines, name in sorted(sizes, reverse=True)[:count]]


def string_prefix_roles() -> list[str]:
    """A side of an evaluation told apart by a string prefix (``name.startswith("hf_")``), in the modules that
    build, run and summarise the sides."""
    found = []
    for module, tree in TREES.items():
        if module not in SIDE_MODULES:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("startswith", "removeprefix") and node.args
                    and isinstance(node.args[0], (ast.Constant, ast.Tuple, ast.Name))):
                found.append(f"{module}:{node.lineno} tells things apart by a prefix")
    return found


def string_owners(value: str) -> list[str]:
    """The modules outside the recipe schema whose code holds the string ``value`` (a format's or a file's name)."""
    return sorted(module for module, tree in TREES.items()
                  if not module.startswith("drafttrain.config")
                  and any(isinstance(n, ast.Constant) and n.value == value for n in ast.walk(tree)))


def serving_formats() -> list[str]:
    from drafttrain.drafts.codecs import codecs_of

    kinds, variants, _, _ = registry()
    return sorted({name for cls in [*kinds.values(), *(v for vs in variants.values() for v in vs)]
                   for name in codecs_of(cls)})


def imports_in_functions() -> tuple[int, int]:
    """(imports inside function bodies, all imports) in drafttrain/."""
    inside = total = 0
    for tree in TREES.values():
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                total += 1
                inside += id(node) in nested
    return inside, total


def main() -> int:
    checks = {"upward imports": upward_imports(), "import circles": [" -> ".join(c) for c in import_circles()],
              f"functions over {MAX_FUNCTION_LINES} lines": long_functions(),
              "kind or variant names outside their own modules": named_kinds(),
              "variant selectors tested in a kind's class or proposer, getattr(..., 'parallel')": variant_flags(),
              "string-prefix side roles": string_prefix_roles()}
    for title, found in checks.items():
        print(f"{title}: {len(found)}")
        for line in found:
            print(f"  {line}")
    inside, total = imports_in_functions()
    longest = max(functions(), key=lambda f: f[2])
    evaluate_lines = next(n for m, name, n in functions() if name == "evaluate" and m.endswith("evaluate"))
    print(f"modules: {len(MODULES)}, functions: {len(functions())}, longest: {longest[0]}.{longest[1]} "
          f"({longest[2]} lines), evaluate(): {evaluate_lines} lines")
    print(f"imports inside function bodies: {inside} of {total} ({100 * inside / total:.0f}%)")
    print(f"largest classes (lines): {', '.join(largest_classes())}")
    print(f"largest modules (lines): {', '.join(largest_modules())}")
    print("modules naming each serving format (its owners: the codecs, the engines that serve it, the commands):")
    for name in serving_formats():
        owners = string_owners(name)
        print(f"  {name}: {len(owners)}: {', '.join(o.removeprefix('drafttrain.') for o in owners)}")
    opens = string_owners("config.json")
    print(f"modules naming config.json: {len(opens)}: {', '.join(o.removeprefix('drafttrain.') for o in opens)}")
    return 1 if any(checks.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
