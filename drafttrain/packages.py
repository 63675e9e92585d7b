"""The packages drafttrain is built on, and one clear line when one of them is missing.

``pip install -e .`` installs every package the product uses (pyproject.toml's dependencies). A package can still
be missing from a broken or hand-made environment; a recipe names what it needs (``config.Section.packages``), and
the recipe is refused before any work starts, naming the package, the recipe field that needs it and the install
command taken from drafttrain's own requirements (one copy of each pin: pyproject.toml).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType

from drafttrain import DrafttrainError

# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "prometheus_client": "prometheus-client"}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        return False


def install_command(module: str) -> str:
    """``pip install 'SPEC'`` with drafttrain's own requirement for ``module`` (its pin), or the bare name."""
    distribution = DISTRIBUTIONS.get(module, module)
    try:
        requirements = importlib.metadata.requires("drafttrain") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        spec = requirement.split(";")[0].strip()
        name = re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0]
        if name.lower().replace("_", "-") == distribution.lower().replace("_", "-") and "extra ==" not in requirement:
            return f"pip install '{name}{_floor_first(spec[len(name):])}'"
    return f"pip install {distribution}"


def _floor_first(specifiers: str) -> str:
    """``<0.22,>=0.18`` (the order package metadata keeps) as ``>=0.18,<0.22``, the order people read a range in."""
    parts = [p.strip() for p in specifiers.split(",") if p.strip()]
    return ",".join(sorted(parts, key=lambda p: not p.startswith((">", "~", "=")))) if parts else ""


def missing_message(module: str, why: str) -> str:
    return (f"{why} needs the package {module}, which is not installed: {install_command(module)} "
            "(`pip install -e .` installs every package drafttrain uses)")


def require(module: str, why: str) -> ModuleType:
    """Import ``module``, or raise one line naming it, what needs it and its install command."""
    if not installed(module):
        raise DrafttrainError(missing_message(module, why))
    return importlib.import_module(module)


def check_installed(needs: list[tuple[str, str]]) -> None:
    """``needs``: (what needs it, module) pairs; the first missing module is refused with both named."""
    for why, module in needs:
        if not installed(module):
            raise DrafttrainError(missing_message(module, why))
