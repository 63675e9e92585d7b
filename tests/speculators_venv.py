"""speculators 0.9.0 in a venv of its own under ``.venvs/`` (never a drafttrain dependency), made by the first test
that needs it (about 20 seconds) and kept for the next runs; a Python named by DRAFTTRAIN_SPECULATORS_PYTHON is used
instead. The venv has speculators, hs-connectors and the versions of transformers and datasets speculators pins;
torch and the other packages it shares with the tests' own environment come from there (a .pth line, so the venv
does not see drafttrain itself). Making it needs the package registry; a machine that cannot reach it fails those
tests with the reason, it does not skip them. tests/speculators_side.py is what runs in it."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

from engine_venv import run_or_raise
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.9.0"
VENV = REPO / ".venvs" / "speculators"
SIDE = Path(__file__).resolve().parent / "speculators_side.py"
# speculators' own pins for the libraries its reading and preparing code uses (its METADATA)
PINNED = ("transformers>=5.0.0,<=5.19.0", "datasets>=4.0.0,<=5.1.0", "openai>=2.0.0", "loguru>=0.7.2,<=0.7.3",
          "typer>=0.12.0")
WORKS = ("import speculators.train.data, hs_connectors, importlib.util, importlib.metadata as m; "
         f"assert m.version('speculators') == {VERSION!r}; assert importlib.util.find_spec('drafttrain') is None")


def _env() -> dict[str, str]:
    """The environment speculators runs in: the tests' own, less the paths that would show it drafttrain."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


def _works(python: Path) -> bool:
    return python.is_file() and subprocess.run([str(python), "-c", WORKS], capture_output=True, env=_env(),
                                               cwd=python.parent).returncode == 0


def speculators_python() -> str:
    """A Python that runs speculators 0.9.0's own code, made once (see the module doc)."""
    given = os.environ.get("DRAFTTRAIN_SPECULATORS_PYTHON")
    if given:
        return given
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(exist_ok=True)
    with FileLock(str(VENV) + ".lock"):  # the suite's workers wait for the one that builds it
        if not _works(python):
            run_or_raise([sys.executable, "-m", "venv", "--clear", str(VENV)], "making the speculators venv")
            purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip()
            Path(purelib, "tests-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
            run_or_raise([str(python), "-m", "pip", "install", "-q", "--no-deps", f"speculators=={VERSION}",
                  f"hs-connectors=={VERSION}"], f"installing speculators=={VERSION}")
            run_or_raise([str(python), "-m", "pip", "install", "-q", *PINNED], "installing speculators' pinned libraries")
            if not _works(python):
                raise RuntimeError(f"{python} was made but does not run speculators {VERSION}")
    return str(python)


def on_speculators_side(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """tests/speculators_side.py with ``args`` in the speculators venv; a failure shows its output."""
    done = subprocess.run([speculators_python(), str(SIDE), *args], capture_output=True, text=True, timeout=timeout,
                          env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done
