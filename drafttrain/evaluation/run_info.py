"""What a report records of the run it measured: the settings, the versions and the machine (nothing that
identifies the host), so two reports can be compared and a model card matched to its weights."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from typing import Any

import torch
import transformers

import drafttrain
from drafttrain.config import DecodeSettings
from drafttrain.targets import Target

TIMING = "wall clock around each generate call, prefill included; method and baseline interleaved"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def describe_tree(tree: Any) -> Any:
    if isinstance(tree, str):
        return tree
    if hasattr(tree, "paths"):  # a StaticTree object
        return {"kind": "static", "paths": [list(p) for p in tree.paths]}
    if dataclasses.is_dataclass(tree):
        return {"kind": type(tree).__name__, **dataclasses.asdict(tree)}
    if isinstance(tree, (list, tuple)):
        return {"kind": "static", "paths": [list(p) for p in tree]}
    return repr(tree)


def jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    name = getattr(value, "name", None)  # a Target: its spec
    return name if isinstance(name, str) else type(value).__name__


def machine_description() -> dict[str, Any]:
    """Enough to compare runs, nothing that identifies the host (no hostname, no user)."""
    return {
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


CONTENDED_SHARE = 0.6  # the run got less than this share of the CPU time its threads could use: others had it


@dataclasses.dataclass
class Budget:
    """A run's wall-clock budget, counted from its creation (None: no budget)."""

    limit_s: float | None
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def spent(self) -> bool:
        return self.limit_s is not None and time.perf_counter() - self.started > self.limit_s

    def summary(self, measured: int, planned: int) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        over = measured < planned
        note = (f"the evaluation ran over its time budget ({self.limit_s / 60:.1f} min; {elapsed / 60:.1f} min "
                f"spent): {measured} of {planned} prompts measured") if over else None
        return {"budget_s": self.limit_s, "elapsed_s": round(elapsed, 1), "prompts_measured": measured,
                "prompts_planned": planned, "over": over, "note": note}


@dataclasses.dataclass
class LoadWatch:
    """Whether the machine was busy while the run measured: the 1-minute load average beside the cores, and the
    CPU time this process got beside what its threads could have used in the wall time. A busy machine makes
    every speed figure noisy and the auto choice's costs wrong, so the report says so in one plain line."""

    load_start: float | None = dataclasses.field(default_factory=lambda: _load())
    cpu_start: float = dataclasses.field(default_factory=time.process_time)
    wall_start: float = dataclasses.field(default_factory=time.perf_counter)

    def summary(self) -> dict[str, Any]:
        wall, cpu = time.perf_counter() - self.wall_start, time.process_time() - self.cpu_start
        threads, cores, load = torch.get_num_threads(), os.cpu_count() or 1, _load()
        share = cpu / (wall * min(threads, cores)) if wall > 0 else None
        busy_load = max(x for x in (self.load_start, load) if x is not None) if load is not None else None
        reasons = []
        if busy_load is not None and busy_load > cores + 0.5:
            reasons.append(f"load average {busy_load:.1f} on {cores} cores")
        if share is not None and share < CONTENDED_SHARE and not torch.cuda.is_available():
            reasons.append(f"this run got {share:.0%} of the CPU time its {threads} threads could use")
        note = (f"the machine was busy while this ran ({'; '.join(reasons)}): speeds and speedups are unreliable; "
                "rerun alone for figures to trust") if reasons else None
        return {"load_1m_start": self.load_start, "load_1m_end": load, "cores": cores, "threads": threads,
                "cpu_share": None if share is None else round(share, 3), "contended": bool(reasons), "note": note}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def run_config(target: Target, settings: DecodeSettings, *, suite: str, questions: list, described: dict[str, Any],
               stop_ids: list[int], started_at: str) -> dict[str, Any]:
    """The report's ``config``: the method's resolved settings (``settings``, after any auto choice), the prompts,
    what each side was (``described``: proposer, draft, baseline, references, compared sides), versions, machine."""
    param = next(target.model.parameters())
    return {
        "target": target.name,
        **{key: described[key] for key in ("proposer", "proposer_kwargs")},
        "depth": settings.depth,
        "tree": describe_tree(settings.tree),
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "max_new_tokens": settings.max_new_tokens,
        "seed": settings.seed,
        "stop_token_ids": list(stop_ids),
        "suite": suite,
        "num_prompts": len(questions),
        "num_turns": sum(len(q.turns) for q in questions),
        **{key: described[key] for key in ("baseline", "hf_reference", "compare", "draft", "min_confidence",
                                        "depth_auto", "tree_auto", "runtime_check")},
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "threads": torch.get_num_threads(),
        "versions": {"drafttrain": drafttrain.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": machine_description(),
        "timing": TIMING,
        "started_at": started_at,
    }
