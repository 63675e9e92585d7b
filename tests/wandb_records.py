"""Read back what a wandb run wrote to its ``run-*.wandb`` file, with wandb's own record schema.

wandb 0.31 ships no Python reader for this file. It is LevelDB's log format (32 KiB blocks of records, each a
7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST) after wandb's 7-byte file header, and each record is a
``wandb_internal_pb2.Record``: the protobuf wandb's own sync sends to the server.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if left < HEADER or (length == 0 and kind == 0):  # block trailer or padding
            position += left
            continue
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def items_of(items) -> dict[str, Any]:
    """Items as a dict (wandb writes a plain key as a key or as a one-part nested key); a longer nested key (a
    logged table or image: ["eval/categories", "_type"]) as a nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        place = out
        for key in keys[:-1]:
            place = place.setdefault(key, {})
        place[keys[-1]] = json.loads(item.value_json)
    return out


def read_run(run_dir: Path) -> dict[str, Any]:
    """{"history": [{key: value}], "metrics": [MetricRecord], "artifacts": [ArtifactRecord], "config": {key: value}}
    of the one wandb run under ``run_dir``."""
    files = sorted(Path(run_dir).rglob("run-*.wandb"))
    assert len(files) == 1, files
    out: dict[str, Any] = {"history": [], "metrics": [], "artifacts": [], "config": {}}
    for record in records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(items_of(record.history.item))
        elif kind == "metric":
            out["metrics"].append(record.metric)
        elif kind == "artifact":
            out["artifacts"].append(record.artifact)
        elif kind in ("config", "run"):  # the run record carries the config given to wandb.init
            config = record.config if kind == "config" else record.run.config
            out["config"].update(items_of(config.update))
    return out
