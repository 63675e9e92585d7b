"""``drafttrain bench``: the speedup users will see in the engine they serve from, from one stream to many.

The target is served plainly and with each draft at each length, all with the same engine settings, and a
concurrency sweep runs over the same prompts (serving.sweep). Before any server starts, drafttrain's evaluator
decodes the one-stream level's prompts with each draft (serving.agreement), so the engine's acceptance at one
stream is checked against ours. The report (report.json, report.md, bench.png) also goes beside each draft's
checkpoint (``CHECKPOINT/bench/``), where ``drafttrain export`` finds it for the model card when the weights match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.config import BenchConfig
from drafttrain.drafts import drafter_for, load_drafter
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.saved import SavedDraft
from drafttrain.engines.server import (
    ENGINES,
    Engine,
    Server,
    Serving,
    Speculation,
    check_exists,
    check_python,
    port_in_use,
)
from drafttrain.evaluation.run_info import machine_description, now
from drafttrain.evaluation.serving_report import PLOT_NAME, plot, write_markdown
from drafttrain.export.writer import BENCH_DIR, REPORT_NAME, export_draft, recorded_target
from drafttrain.runfolder import MANIFEST, read_json, write_text_atomic
from drafttrain.serving.agreement import compare, drafttrain_side
from drafttrain.serving.prompts import BenchPrompts, bench_prompts
from drafttrain.serving.sweep import SWEEP_FILE, SweepSide, build_levels, jobs, run_load
from drafttrain.targets import Target, load_target
from drafttrain.targets.loading import load_tokenizer, resolve_model_dir

log = logging.getLogger(__name__)

NGRAM = "ngram"  # the engine's own n-gram lookup: no draft to load
NGRAM_SERVING = {"vllm": Serving("ngram"), "sglang": Serving("NGRAM")}


@dataclasses.dataclass
class Draft:
    """A draft to serve: its name in the report, how each engine serves it (its format's codec says), the export the
    engine loads, and the checkpoint it came from."""

    name: str
    serving: dict[str, Serving]
    export: Path | None = None
    checkpoint: Path | None = None
    drafter: Any = None
    weights_sha256: str | None = None

    def speculation(self, length: int) -> Speculation:
        return Speculation(self.name, length, self.serving, str(self.export) if self.export else None,
                           self.weights_sha256)


@dataclasses.dataclass
class BenchInputs:
    drafts: list[str]
    target: str | None
    python: str | None
    base_url: str | None = None
    plain_base_url: str | None = None
    suite: str = "mt_bench"
    request_log: str | None = None


def resolve_draft(source: str, engine: Engine, target: Target, out: Path) -> Draft:
    """``ngram``, an export folder (served as it is) or a run or checkpoint (exported here in the first format the
    engine serves)."""
    if source == NGRAM:
        return Draft(NGRAM, NGRAM_SERVING)
    saved = SavedDraft.open(source)
    path = saved.directory
    built_from = export_record(path)
    drafter = load_drafter(saved, target)
    codecs, name = codecs_of(type(drafter)), Path(source).resolve().name
    if built_from is not None:  # an export: served as written
        return Draft(name, codecs[built_from["format"]].serving(drafter), path, Path(built_from["checkpoint"]),
                     drafter, built_from.get("weights_sha256"))
    formats = served_formats(drafter, engine)
    if not formats:
        raise DrafttrainError(f"{engine.name} serves no format a {drafter.kind} draft like {source} is written in "
                              f"(it writes {', '.join(drafter.export_formats())})")
    export = export_draft(saved, formats[0], out / "exports" / f"{name}-{formats[0]}", target, overwrite=True)
    return Draft(name, codecs[formats[0]].serving(drafter), export, path, drafter,
                 drafter.identity()["weights_sha256"])


def served_formats(drafter, engine: Engine) -> list[str]:
    """The formats this draft is written in that ``engine`` serves, the one it prefers first."""
    codecs = codecs_of(type(drafter))
    return [f for f in drafter.export_formats() if engine.name in codecs[f].engines]


def export_record(path: Path) -> dict[str, Any] | None:
    """What the export folder ``path`` was built from (None: a checkpoint, not an export)."""
    built_from = read_json(path / MANIFEST).get("built_from", {}) if (path / MANIFEST).is_file() else {}
    return built_from if "format" in built_from else None


def check_inputs(inputs: BenchInputs, settings: BenchConfig, engine: Engine) -> str:
    """Every check that needs no model, before anything loads: the engine's Python, the servers' ports, the
    formats of exports given as they are. Returns the engine's version."""
    if inputs.python is None:  # the load generator runs there too, also against servers given by URL
        raise DrafttrainError(f"give --{engine.name}-python: a Python with {engine.name} installed (never a drafttrain "
                              "dependency), or set DRAFTTRAIN_VLLM_PYTHON")
    check_exists(engine, inputs.python)
    if (inputs.base_url is None) != (inputs.plain_base_url is None):
        raise DrafttrainError("servers already running are given in pairs: --base-url (with the draft) and "
                              "--plain-base-url (without)")
    if inputs.base_url is None:
        servers = 1 + len(inputs.drafts) * len(settings.num_speculative_tokens)
        busy = [port for port in range(settings.port, settings.port + servers) if port_in_use(port)]
        if busy:
            raise DrafttrainError(f"port {busy[0]} is in use (another server?): choose another --port (the sweep "
                                  f"uses {servers} consecutive ports from it)")
    for source in inputs.drafts:
        saved = SavedDraft.open(source) if source != NGRAM else None
        built_from = export_record(saved.directory) if saved is not None else None
        if built_from is None:
            continue
        codecs = codecs_of(drafter_for(saved.section()))
        if engine.name not in codecs[built_from["format"]].engines:
            served = " or ".join(fmt for fmt, codec in codecs.items() if engine.name in codec.engines)
            advice = f"export it again with --format {served}" if served else f"{engine.name} serves none of its formats"
            raise DrafttrainError(f"{source} is in the {built_from['format']} format, which {engine.name} does not "
                                  f"serve: {advice}")
    return check_python(engine, inputs.python)


def target_of(inputs: BenchInputs) -> str:
    if inputs.target is not None:
        return inputs.target
    trained = [recorded_target(SavedDraft.open(d)) for d in inputs.drafts if d != NGRAM]
    if not trained:
        raise DrafttrainError("name the target (--target) when the only draft is the engine's n-gram lookup")
    return trained[0]


def servers_for(drafts: list[Draft], settings: BenchConfig, engine: Engine, inputs: BenchInputs, target_dir: str,
                out: Path) -> list[SweepSide]:
    """Plain serving first, then each draft at each length: one server each, on consecutive ports (or the servers
    given by URL)."""
    specs = [None] + [d.speculation(k) for d in drafts for k in settings.num_speculative_tokens]
    if inputs.base_url is not None:
        if len(specs) != 2:
            raise DrafttrainError("--base-url serves one draft at one length: give one draft and one "
                                  "--num-speculative-tokens")
        urls = [inputs.plain_base_url, inputs.base_url]
    else:
        urls = [None] * len(specs)
    fraction = settings.memory_fraction / len(specs)
    extra = ["--dtype", settings.dtype, *settings.server_args]
    sides = []
    for i, (spec, url) in enumerate(zip(specs, urls)):
        server = Server(engine, inputs.python, target_dir, spec, settings.port + i, out / "logs" / f"server{i}.log",
                        fraction, base_url=url, extra_args=extra)
        sides.append(SweepSide(server.label, spec.label if spec else None, spec.length if spec else None, server))
    return sides


def our_side(draft: Draft, target: Target, prompts: BenchPrompts, settings: BenchConfig, length: int) -> dict[str, Any]:
    return drafttrain_side(target, draft.drafter, prompts.ids, settings.requests_at(1), length,
                           settings.output_len, prompts.stop_ids)


def run_bench(inputs: BenchInputs, settings: BenchConfig, out: Path) -> dict[str, Any]:
    """Check every input, decode the one-stream prompts with drafttrain, serve and sweep, and write the report."""
    engine, started, clock = ENGINES[settings.engine], now(), time.monotonic()
    version = check_inputs(inputs, settings, engine)
    target_name = target_of(inputs)
    target_dir = resolve_model_dir(target_name)
    trained = [d for d in inputs.drafts if d != NGRAM]
    target = load_target(target_name) if trained else None
    tokenizer = target.tokenizer if target is not None else load_tokenizer(target_name)
    prompts = bench_prompts(tokenizer, target.model.generation_config if target is not None else None,
                            None if inputs.request_log else inputs.suite, inputs.request_log, settings.num_prompts)
    out.mkdir(parents=True, exist_ok=True)
    drafts = [resolve_draft(d, engine, target, out) for d in inputs.drafts]
    _unique([d.name for d in drafts])
    sides = servers_for(drafts, settings, engine, inputs, target_dir, out)
    checking = settings.temperature == 0 and 1 in settings.concurrency
    ours = {(d.name, k): our_side(d, target, prompts, settings, k)
            for d in drafts if d.drafter is not None and checking for k in settings.num_speculative_tokens}
    serve_and_sweep(sides, settings, engine, inputs.python, target_dir, prompts, out)
    report = _report(engine, version, target_name, prompts, settings, sides, out, started, clock)
    _agreement(report, sides, ours, settings)
    report["errors"] += length_errors(report)
    for level in report["levels"]:  # the answers stay in raw/: the report goes on model cards, and traffic is private
        for row in level["sides"].values():
            row.pop("generated_texts", None)
    _write(report, out, drafts)
    return report


def serve_and_sweep(sides: list[SweepSide], settings: BenchConfig, engine: Engine, python: str, target_dir: str,
                    prompts: BenchPrompts, out: Path) -> None:
    """Start every side's server, run the load generator over the levels, stop the servers: the raw figures are in
    ``out`` (``build_levels`` reads them)."""
    _describe(out, sides, settings, engine)
    dataset = prompts.write_dataset(max(settings.requests_at(c) for c in settings.concurrency), out / "prompts.jsonl")
    with contextlib.ExitStack() as stack:
        for side in sides:  # one at a time: engines profiling memory side by side on one GPU misjudge it
            stack.enter_context(side.server)
            side.server.wait_ready(settings.startup_timeout_s)
        run_load(python, jobs(sides, settings, target_dir, dataset, prompts.request_body(), out), out, sides)


def _unique(names: list[str]) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise DrafttrainError(f"two drafts are named {sorted(seen)[0]!r} (their folders' names): copy one elsewhere")


def _describe(out: Path, sides: list[SweepSide], settings: BenchConfig, engine: Engine) -> None:
    (out / SWEEP_FILE).write_text(json.dumps({"engine": engine.name, "config": settings.model_dump(),
                                              "sides": [s.described() for s in sides]}, indent=1))


def _report(engine, version, target_name, prompts, settings, sides, out, started, clock) -> dict[str, Any]:
    return {"engine": {"name": engine.name, "version": version, "tested_here": engine.tested},
            "target": target_name, "config": settings.model_dump(),
            "prompts": {"source": prompts.source, "count": len(prompts.texts)},
            "sides": [s.described() for s in sides], "levels": build_levels(engine, out),
            "started_at": started, "duration_s": round(time.monotonic() - clock, 1), "machine": machine_description(),
            "errors": []}


def _agreement(report: dict[str, Any], sides: list[SweepSide], ours: dict, settings: BenchConfig) -> None:
    if not ours:
        report["agreement_skipped"] = ("not checked: it needs T=0, concurrency 1 among the levels and a trained "
                                       "draft (the engine's n-gram lookup has no drafttrain counterpart)")
        return
    one = next(level for level in report["levels"] if level["concurrency"] == 1)
    report["agreement"] = []
    for side in sides:
        if (side.draft, side.length) in ours:
            row, error = compare(side.label, one["sides"].get(side.label), ours[side.draft, side.length],
                                 settings.agreement_tolerance)
            report["agreement"].append(row)
            if error:
                report["errors"].append(error)


def length_errors(report: dict[str, Any]) -> list[str]:
    """The engine counts acceptance at as many positions as it drafts: a server given by URL that drafts another
    length than the one its side is labelled with is named (its figures belong to another length)."""
    errors = []
    for side in report["sides"]:
        counted = {len(level["sides"][side["label"]].get("acceptance_per_position") or []) for level in report["levels"]}
        counted.discard(0)
        if side["draft"] is not None and counted and counted != {side["length"]}:
            errors.append(f"{side['label']}: the server at {side['base_url']} drafts {max(counted)} tokens, not "
                          f"{side['length']}: give its --num-speculative-tokens")
    return errors


def _write(report: dict[str, Any], out: Path, drafts: list[Draft]) -> None:
    write_text_atomic(out / REPORT_NAME, json.dumps(report, indent=1))
    write_markdown(report, out / "report.md")
    plot(report, out / PLOT_NAME)
    for draft in drafts:
        if draft.checkpoint is not None and not draft.checkpoint.is_dir():
            log.warning("%s was exported from %s, which is not here: the sweep is not put beside it for its card",
                        draft.export, draft.checkpoint)
        elif draft.checkpoint is not None:
            beside = draft.checkpoint / BENCH_DIR
            beside.mkdir(exist_ok=True)
            for name in (REPORT_NAME, "report.md", PLOT_NAME):
                shutil.copyfile(out / name, beside / name)
