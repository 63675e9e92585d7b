"""The machine a run goes to: GPUs (or processes) per node, nodes, each GPU's memory and the free disk, given
(``drafttrain plan``'s flags, a DeepSpeed hostfile) or read from the launch (:func:`this_machine`)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import torch

from drafttrain import DrafttrainError
from drafttrain.config import Recipe


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the run goes: ``gpus`` processes per node (one per GPU; on CPU, processes per machine), ``nodes``
    machines, ``gpu_memory`` bytes per GPU (None on CPU, or when unknown)."""
    gpus: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    disk_free: int | None = None

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


def this_machine(recipe: Recipe) -> Cluster:
    """The cluster a run launched here has: accelerate's process counts, this device's memory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    memory = None
    if recipe.target.device.startswith("cuda") and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Cluster(gpus=local, nodes=max(world // max(local, 1), 1), gpu_memory=memory)


def read_hostfile(path: str | Path) -> dict[str, int]:
    """A DeepSpeed hostfile (``host slots=N`` per line) as {host: slots}; every host must resolve, so that a typo
    is named now rather than by a launcher that hangs waiting for it."""
    file = Path(path)
    if not file.is_file():
        raise DrafttrainError(f"hostfile not found: {file}")
    hosts: dict[str, int] = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" ")
        if not slots.strip().startswith("slots=") or not slots.strip()[6:].isdigit():
            raise DrafttrainError(f"hostfile {file}, line {number}: expected 'HOST slots=N', got {line!r}")
        try:
            socket.getaddrinfo(host, None)
        except OSError:
            raise DrafttrainError(f"hostfile {file}, line {number}: unknown host {host!r} (it does not resolve "
                                  "from this machine)") from None
        hosts[host] = int(slots.strip()[6:])
    if not hosts:
        raise DrafttrainError(f"hostfile {file} names no hosts")
    if len(set(hosts.values())) != 1:
        raise DrafttrainError(f"hostfile {file}: every node needs the same number of slots (GPUs), got {hosts}")
    return hosts
