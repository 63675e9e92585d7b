"""The libraries drafttrain reaches into, at other versions than the installed ones: each is installed into a
scratch venv (sharing this environment's other packages, torch included) and the family matrix and the fast tests
run against it. ``--newest`` takes every library's newest release, whatever pyproject.toml allows: how a ceiling is
raised (see the README's developer section). ``--floor`` takes each library's floor in pyproject.toml.

    python scripts/tools/check_versions.py --newest            # or --floor, or --pin transformers==5.25.0 ...
    python scripts/tools/check_versions.py --newest --tests tests/test_families.py   # a narrower set

Prints the versions tested, each library's range in pyproject.toml, whether the newest release lies inside it, and
pytest's summary; exit status 0 when the tests pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the libraries whose internals drafttrain uses (cache classes, launch and ZeRO hooks, adapters, Arrow datasets)
TRACKED = ("transformers", "accelerate", "deepspeed", "peft", "datasets")
MATRIX = ["tests/test_families.py", "tests/test_published_families.py"]


def declared_ranges() -> dict[str, str]:
    """Each tracked library's requirement in pyproject.toml, e.g. {"transformers": ">=5.24,<5.26"}."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {}
    for requirement in dependencies:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", requirement)
        if match and match.group(1).lower() in TRACKED:
            ranges[match.group(1).lower()] = match.group(2).strip()
    return ranges


def floor_of(spec: str) -> str:
    match = re.search(r">=\s*([0-9][^,\s]*)", spec)
    if not match:
        raise SystemExit(f"no floor (>=) in {spec!r}")
    return match.group(1)


def requirements(args) -> list[str]:
    if args.pin:
        return args.pin
    if args.floor:
        return [f"{name}=={floor_of(spec)}" for name, spec in declared_ranges().items()]
    return [f"{name}" for name in TRACKED]  # with --upgrade: each one's newest release


def make_venv(folder: Path, wanted: list[str], newest: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(folder)], check=True)
    python = folder / "bin" / "python"
    # torch stays the installed build: a newer torch from PyPI would be a CUDA build of several GB
    torch_pin = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    command = [str(python), "-m", "pip", "install", "-q", *(["--upgrade"] if newest else []), *wanted,
               f"torch=={torch_pin}"]
    subprocess.run(command, check=True)
    return python


def installed(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in %r}))" % (TRACKED,))
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def within(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return version in SpecifierSet(spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--newest", action="store_true", help="every tracked library's newest release")
    which.add_argument("--floor", action="store_true", help="every tracked library at its floor in pyproject.toml")
    which.add_argument("--pin", nargs="+", metavar="NAME==VERSION", help="these versions")
    parser.add_argument("--tests", nargs="+", help="pytest arguments (default: the family matrix, then the fast "
                        "tests: -m 'not slow')")
    parser.add_argument("--venv", type=Path, help="the scratch venv's folder (default: a new temporary one)")
    args = parser.parse_args()
    folder = args.venv or Path(tempfile.mkdtemp(prefix="drafttrain-versions-")) / "venv"
    python = make_venv(folder, requirements(args), args.newest)
    versions, ranges = installed(python), declared_ranges()
    for name in TRACKED:
        inside = "inside" if within(versions[name], ranges.get(name, "")) else "OUTSIDE"
        print(f"{name:13s} {versions[name]:10s} pyproject {ranges.get(name, '(any)'):18s} {inside}", flush=True)
    # a cache of its own: the built-in targets are converted by these versions too
    env = {**os.environ, "DRAFTTRAIN_CACHE": str(folder.parent / "cache")}
    runs = [args.tests] if args.tests else [MATRIX, ["-m", "not slow"]]
    status = 0
    for tests in runs:
        done = subprocess.run([str(python), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                              cwd=REPO, env=env, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines() or ["(no output)"]
        print(f"pytest {' '.join(tests)}: {lines[-1]}", flush=True)
        if done.returncode:
            failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
            print("\n".join(failed) or done.stdout[-4000:] + "\n" + done.stderr[-2000:])
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
