"""A clone is all a test or a script needs: nothing reads a folder beside the repository, a machine's own paths, or
a place an environment variable names outside the clone. At run time every test is watched (tests/outside.py: what
it opens, whatever named the path); the scripts, which tests do not all run, are read for such paths."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import OUTSIDE, REPO
from outside import SYSTEM

BESIDE = REPO.parent / "a-folder-beside-the-clone"
ABSOLUTE = re.compile(r"(?:^|(?<=[\s\"'=(\[])|(?<=:-))/[A-Za-z][\w.-]*(?:/[\w.-]+)+", re.M)
# paths a test gives because they do not exist (a missing draft, a placeholder in a usage line), and HTTP routes
NOWHERE = ("/path/to/", "/no/", "/nonexistent/", "/v1/")
ESCAPES = re.compile(r"\.\./(?:\.\./)*(?:shared|data|eval)\b|shared/data")


def test_a_read_beside_the_clone_fails_the_test_that_made_it(monkeypatch):
    monkeypatch.setenv("SOME_DATA_DIR", str(BESIDE))
    for path in (BESIDE / "train.jsonl", Path(__import__("os").environ["SOME_DATA_DIR"]) / "eval.jsonl"):
        with pytest.raises(FileNotFoundError):
            open(path)
    assert OUTSIDE.take() == [str(BESIDE / "train.jsonl"), str(BESIDE / "eval.jsonl")]  # taken: this test passes


def test_reads_inside_the_clone_and_the_system_are_not_recorded(tmp_path):
    (REPO / "README.md").read_text()
    (tmp_path / "x").write_text("x")
    Path("/etc/hostname").exists() and Path("/etc/hostname").read_text()
    assert OUTSIDE.take() == []


def _sources() -> list[Path]:
    """The scripts and the tests' fixture makers, which no test runs (the tests themselves are watched as they run:
    a path they only compare, a cluster's folder in a recipe under test, is never opened)."""
    return sorted(p for folder in ("scripts", "tests/fixtures") for p in (REPO / folder).rglob("*")
                  if p.suffix in (".py", ".sh") and p.is_file())


def _escaping_parents(tree: ast.AST, depth: int) -> list[str]:
    """``Path(__file__)...parents[k]`` reaching above the clone, and ``REPO.parent``-style climbs out of it."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)
                and "__file__" in ast.unparse(node.value) and node.slice.value > depth):
            found.append(ast.unparse(node))
        if (isinstance(node, ast.Attribute) and node.attr in ("parent", "parents")
                and isinstance(node.value, ast.Name) and node.value.id in ("REPO", "ROOT")):
            found.append(ast.unparse(node))
    return found


def _outside_paths(text: str) -> list[str]:
    paths = [m.group(0) for m in ABSOLUTE.finditer(text) if not m.group(0).startswith(SYSTEM + NOWHERE)]
    return paths + [m.group(0) for m in ESCAPES.finditer(text)]


def test_no_script_names_a_path_outside_the_clone():
    found = []
    for path in _sources():
        text, rel = path.read_text(), path.relative_to(REPO)
        found += [f"{rel}: {p}" for p in _outside_paths(text)]
        if path.suffix == ".py":
            found += [f"{rel}: {p}" for p in _escaping_parents(ast.parse(text), len(rel.parts) - 1)]
    assert found == []


def test_the_scan_finds_what_it_looks_for():
    text = 'SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"\nV = "/home/me/venvs/vllm/bin/python"\n'
    assert _escaping_parents(ast.parse(text), 1) == ["Path(__file__).resolve().parents[2]"]
    assert _escaping_parents(ast.parse("X = REPO.parent / 'shared'"), 1) == ["REPO.parent"]
    assert _outside_paths(text) == ["/home/me/venvs/vllm/bin/python"]
    assert _outside_paths("python x.py ../../shared/train") == ["../../shared"]
    assert _outside_paths("DATA=/data/shared/data/x.json") == ["/data/shared/data/x.json", "shared/data"]
    assert _outside_paths("venv=${VENV:-/opt/venvs/trl}") == ["/opt/venvs/trl"]
    assert _outside_paths("open('/tmp/x'); p = '/usr/bin/env'; f'{url}/v1/chat'; '${RUN}/data/x'; '/no/such'") == []
