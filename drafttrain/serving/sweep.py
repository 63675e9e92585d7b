"""A concurrency sweep: every side (plain serving, and each draft at each length) is one server; the load
generator (vLLM's ``vllm bench serve``) drives them level by level, the sides' order alternating from level to
level so that a drift of the machine falls on every side alike, and each server's counters are read just before
and just after its level.

Everything a level produced stays in ``OUT/raw/`` (the load generator's result, the two /metrics readings) beside
``OUT/sweep.json`` (the sides and levels), so the report is rebuilt from files alone (``build_levels``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
from collections import deque
from pathlib import Path
from statistics import mean
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.engines.server import PLAIN, Engine, Server
from drafttrain.runfolder import read_json

log = logging.getLogger(__name__)

DRIVER = Path(__file__).with_name("loadgen_driver.py")
SWEEP_FILE = "sweep.json"
WARMUP_REQUESTS, WARMUP_TOKENS = 2, 16
LATENCIES = ("ttft", "tpot", "itl")
PERCENTILES = (50, 95)


@dataclasses.dataclass
class SweepSide:
    label: str
    draft: str | None  # the draft's name in the report (None: plain serving)
    length: int | None
    server: Server

    def described(self) -> dict[str, Any]:
        return {"label": self.label, "draft": self.draft, "length": self.length, "base_url": self.server.base_url,
                "weights_sha256": self.server.spec.weights_sha256 if self.server.spec else None}


def schedule(sides: int, levels: list[int], repeats: int) -> list[tuple[int, int, int]]:
    """(side, concurrency, repeat) in the order they run: level by level, each level's sides in turn, the order
    reversed on every other level and pass."""
    order = []
    for repeat in range(repeats):
        for i, concurrency in enumerate(levels):
            turn = range(sides) if (repeat + i) % 2 == 0 else reversed(range(sides))
            order += [(side, concurrency, repeat) for side in turn]
    return order


def level_dir(out: Path, side: int, concurrency: int, repeat: int) -> Path:
    return out / "raw" / f"side{side}" / f"c{concurrency}-r{repeat}"


def loadgen_args(server: Server, tokenizer: str, dataset: Path, requests: int, concurrency: int, output_len: int,
                 temperature: float, body: dict, result: Path | None) -> list[str]:
    args = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", server.base_url,
            "--model", server.target, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(dataset), "--disable-shuffle", "--skip-chat-template",
            "--num-prompts", str(requests), "--custom-output-len", str(output_len),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", str(temperature),
            "--extra-body", json.dumps(body), "--percentile-metrics", ",".join(LATENCIES),
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm"]
    if result is not None:
        args += ["--save-result", "--save-detailed", "--result-dir", str(result.parent),
                 "--result-filename", result.name]
    return args


def jobs(sides: list[SweepSide], config, tokenizer: str, dataset: Path, body: dict, out: Path) -> list[dict]:
    """The load generator's work list: a short unmeasured warm-up per server, then every level in schedule."""
    todo = [{"label": f"warm-up {s.label}", "metrics_url": None,
             "args": loadgen_args(s.server, tokenizer, dataset, WARMUP_REQUESTS, 1, WARMUP_TOKENS,
                                  config.temperature, body, None)} for s in sides]
    for index, concurrency, repeat in schedule(len(sides), config.concurrency, config.repeats):
        side, where = sides[index], level_dir(out, index, concurrency, repeat)
        where.mkdir(parents=True, exist_ok=True)
        todo.append({"label": f"{side.label} c={concurrency}" + (f" pass {repeat + 1}" if config.repeats > 1 else ""),
                     "metrics_url": side.server.base_url + "/metrics", "before": str(where / "before.txt"),
                     "after": str(where / "after.txt"),
                     "args": loadgen_args(side.server, tokenizer, dataset, config.requests_at(concurrency),
                                          concurrency, config.output_len, config.temperature, body,
                                          where / "result.json")})
    return todo


def run_load(python: str, todo: list[dict], out: Path, sides: list[SweepSide]) -> None:
    """Run the load generator over ``todo`` in the engine's Python, a line per finished level; a failed level is
    an error naming the server that failed, with its log."""
    (out / "jobs.json").write_text(json.dumps(todo, indent=1))
    tail: deque[str] = deque(maxlen=40)
    with (out / "loadgen.log").open("w") as output, \
            subprocess.Popen([python, str(DRIVER), str(out / "jobs.json")], stdout=output, stderr=subprocess.PIPE,
                             text=True) as driver:
        try:
            for line in driver.stderr:  # into the log too: a traceback belongs there beside the tables
                output.write(line)
                output.flush()
                tail.append(line.rstrip())
                if line.startswith("run "):
                    log.info("%s", line.rstrip())
            code = driver.wait()
        finally:
            if driver.poll() is None:
                driver.kill()
    if code != 0:
        for side in sides:
            side.server.check_alive("during the sweep")
        raise DrafttrainError("the load generator failed (its output: " + str(out / "loadgen.log") + "):\n"
                              + "\n".join(tail))


def read_level(engine: Engine, where: Path) -> dict[str, Any]:
    """One level of one side: the load generator's throughput and latencies, and the engine's counters over it."""
    result = read_json(where / "result.json")
    row = {"completed": result["completed"], "failed": result.get("failed", 0),
           "duration_s": result["duration"], "output_throughput": result["output_throughput"],
           "request_throughput": result["request_throughput"],
           "generated_texts": result.get("generated_texts")}
    for name in LATENCIES:
        for p in PERCENTILES:
            row[f"{name}_p{p}_ms"] = result.get(f"p{p}_{name}_ms")
    before, after = (engine.counters((where / f).read_text()) for f in ("before.txt", "after.txt"))
    if before is not None and after is not None:
        delta = after - before
        row.update(verify_steps=delta.verify_steps, accepted=delta.accepted,
                   acceptance_length=delta.acceptance_length(), acceptance_per_position=delta.per_position())
    return row


def build_levels(engine: Engine, out: Path) -> list[dict[str, Any]]:
    """Every level's figures per side from ``OUT/raw`` (repeats averaged, counters added), with the speedup of
    output tokens/s against the plain side at the same level."""
    sweep = read_json(out / SWEEP_FILE)
    levels = []
    for concurrency in sweep["config"]["concurrency"]:
        sides = {}
        for index, side in enumerate(sweep["sides"]):
            runs = [read_level(engine, level_dir(out, index, concurrency, r)) for r in range(sweep["config"]["repeats"])]
            sides[side["label"]] = _merged(runs)
        plain = sides[PLAIN]["output_throughput"]
        for row in sides.values():
            row["speedup"] = row["output_throughput"] / plain if plain else None
        levels.append({"concurrency": concurrency, "sides": sides})
    return levels


COUNTS = ("completed", "failed", "verify_steps", "accepted")  # added over passes; rates and latencies averaged


def _merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several passes of one side at one level as one row: counts added, rates and latencies averaged, the
    engine's acceptance weighted by each pass's verification steps (a pass that drafted nothing weighs nothing)."""
    if len(runs) == 1:
        return runs[0]
    row: dict[str, Any] = {"generated_texts": runs[0].get("generated_texts")}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        numbers = [v for v in values if isinstance(v, (int, float))]
        if key in COUNTS:
            row[key] = sum(values) if len(numbers) == len(values) else None
        elif key not in ("generated_texts", "acceptance_length", "acceptance_per_position"):
            row[key] = mean(numbers) if numbers else None
    if "verify_steps" in runs[0]:
        drafting = [r for r in runs if r["verify_steps"]]
        steps = sum(r["verify_steps"] for r in drafting)
        width = max((len(r["acceptance_per_position"]) for r in drafting), default=0)
        share = lambda r, i: r["acceptance_per_position"][i] if i < len(r["acceptance_per_position"]) else 0.0  # noqa: E731
        row["acceptance_length"] = (sum(r["acceptance_length"] * r["verify_steps"] for r in drafting) / steps
                                    if steps else None)
        row["acceptance_per_position"] = [sum(share(r, i) * r["verify_steps"] for r in drafting) / steps
                                          for i in range(width)]
    row["passes"] = len(runs)
    row["output_throughput_per_pass"] = [r["output_throughput"] for r in runs]
    return row
