"""ruff's small rule set (pyproject.toml [tool.ruff]: errors that stop a module, unused and undefined names, import
order) holds over the package, the tests and the scripts; the README's test command, which CI runs, runs it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import REPO


def test_ruff_finds_nothing():
    # this interpreter's ruff, whatever PATH holds
    assert importlib.util.find_spec("ruff") is not None, "ruff is not installed: pip install -e '.[dev]' (it pins ruff)"
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "drafttrain", "tests", "scripts"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
