"""ruff's small rule set (pyproject.toml [tool.ruff]: errors that stop a module, unused and undefined names, import
order) holds over the package, the tests and the scripts; the README's test command, which CI runs, runs it."""

from __future__ import annotations

import shutil
import subprocess

from conftest import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -e '.[dev]' (it pins ruff)"
    proc = subprocess.run([ruff, "check", "drafttrain", "tests", "scripts"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
