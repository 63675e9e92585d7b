"""The package's layers: data -> targets -> drafts -> training -> decoding -> evaluation -> export -> commands,
on a foundation of shared rules (config, runfolder, sampling). A module may import its own layer and the layers
below it, never one above, and no imports may go in a circle. Every import counts: module level, inside
functions, and module names given to importlib as strings."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "drafttrain"
LAYERS = ["foundation", "data", "targets", "drafts", "training", "decoding", "evaluation", "export", "commands", "main"]
FOUNDATION = {"drafttrain", "drafttrain.config", "drafttrain.runfolder", "drafttrain.sampling", "drafttrain.cpu_linear"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    if module == "drafttrain.__main__":
        return "main"
    part = module.split(".")[1]
    if part not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS (or it to FOUNDATION)")
    return part


def resolve(name: str) -> str | None:
    """The drafttrain module an imported name means (a submodule when it is one), or None for others."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule; a name comes from pkg
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("drafttrain."):
            found.add(node.value)  # importlib.import_module("drafttrain.x.y") and registries of module names
    resolved = {resolve(name) for name in found if name.split(".")[0] == "drafttrain"}
    return {m for m in resolved if m and m != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module):
    mine = LAYERS.index(layer_of(module))
    upward = sorted(m for m in GRAPH[module] if LAYERS.index(layer_of(m)) > mine)
    assert not upward, f"{module} ({layer_of(module)}) imports from layers above it: {upward}"


def test_no_imports_go_in_a_circle():
    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [cycle_from(m) for m in sorted(MODULES)]
    assert not any(circles), " -> ".join(next(c for c in circles if c))


def test_the_checker_sees_what_it_must(tmp_path):
    """Guard: the parser finds lazy imports, relative imports, `from pkg import submodule` and importlib strings."""
    assert "drafttrain.drafts.losses" in GRAPH["drafttrain.drafts.eagle3"]  # from drafttrain.drafts import losses
    assert "drafttrain.commands.prepare" in GRAPH["drafttrain.commands"]  # a module name in a string
    assert "drafttrain.evaluation.checkpoint_eval" in GRAPH["drafttrain.commands.train"]  # inside a function
    assert list(itertools.islice(GRAPH, 1))  # not empty


def test_the_trainer_prepare_and_evaluators_never_name_a_draft_kind():
    """A kind is its registry entry: the shared stages ask the drafter, never test for a kind by name."""
    kinds = ("eagle", "medusa", "draft_model")
    shared = ["drafttrain/training/trainer.py", "drafttrain/commands/prepare.py", "drafttrain/commands/train.py",
              "drafttrain/evaluation/checkpoint_eval.py", "drafttrain/evaluation/evaluate.py"]
    for path in shared:
        code = "\n".join(line for line in (PACKAGE.parent / path).read_text().splitlines()
                         if not line.strip().startswith("#"))
        tree = ast.parse(code)
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        compared = [s for s in strings if s in kinds or s in ("eagle3",)]
        assert not compared, f"{path} names draft kinds {compared}"
