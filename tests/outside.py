"""What a test may read: the clone, and the places any Python program reads (its installation, the system, temporary
folders and caches). Every other file a test process opens is recorded by an audit hook (tests/conftest.py), and
the test that opened it fails: a user's clone has nothing beside it, so a test that reads a folder next to the
repository (or one an environment variable names) passes only on the machine it was written on."""

from __future__ import annotations

import os
import site
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM = ("/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/run", "/var/lib",
          "/var/cache", "/var/tmp", "/tmp")
HOME_CACHES = (".cache", ".config", ".local", ".triton")  # what libraries keep per user (models, settings, kernels)
CACHE_VARIABLES = ("HF_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "DRAFTTRAIN_CACHE", "DRAFTTRAIN_ANSWER_STORE",
                   "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "WANDB_DIR", "WANDB_CACHE_DIR",
                   "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")
EVENTS = ("open", "os.listdir", "os.scandir")


def allowed_roots() -> tuple[str, ...]:
    roots = {str(REPO), tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
             site.getusersitepackages(), *SYSTEM, *(str(Path.home() / name) for name in HOME_CACHES)}
    roots |= {os.environ[name] for name in CACHE_VARIABLES if os.environ.get(name)}
    places = {os.path.abspath(root) for root in roots} | {os.path.realpath(root) for root in roots}
    return tuple(os.path.join(place, "") for place in places)


class OutsideReads:
    """An audit hook recording files opened (or folders listed) outside ``allowed_roots()``."""

    def __init__(self):
        self.roots = allowed_roots()
        self.found: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event not in EVENTS or not args or isinstance(args[0], int) or args[0] is None:
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if not os.path.join(path, "").startswith(self.roots):
            self.found.append(path)

    def take(self) -> list[str]:
        found, self.found = self.found, []
        return found
