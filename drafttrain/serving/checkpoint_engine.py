"""Acceptance in the serving engine at every checkpoint (``eval.engine: vllm``).

A checkpoint is exported through its kind's codec (``eval.engine_settings.format``, else the first format the draft
is written in that the engine reads), the target is served by the engine plainly and with the draft (a chain of
eval's depth), and the run's held-out prompts (the first turns of ``data/validation_prompts.jsonl`` that the reported
suite does not hold, as drafttrain's own checkpoint evaluation takes them) are sent one at a time: the engine's
counters give the acceptance per position and τ, the load generator the speedup over plain serving, with the pieces
``drafttrain bench`` uses (serving/bench.py, serving/sweep.py). Where this process holds the whole target, drafttrain's
evaluator decodes the same prompts with the same checkpoint and the two τ are compared (serving/agreement.py).

The record goes beside the checkpoint (``CHECKPOINT/engine.json``; the servers' logs and the engine's raw figures in
``CHECKPOINT/engine/``), so each checkpoint is measured once, inline by the trainer or by ``drafttrain watch``. A draft
the engine cannot serve is measured by drafttrain's evaluator instead where the target is whole here, else by its
held-out accuracy alone, and its records say so (``engine_fallback``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from transformers import GenerationConfig

from drafttrain import DrafttrainError
from drafttrain.config import BenchConfig, EngineEvalSettings, Recipe
from drafttrain.drafts import drafter_for, load_drafter
from drafttrain.drafts.codecs import codecs_of
from drafttrain.engines.capture import Parallelism
from drafttrain.engines.server import ENGINES, PLAIN, Engine, check_exists, check_python, port_in_use
from drafttrain.evaluation.checkpoint_eval import CheckpointEvaluator, selection_prompts
from drafttrain.evaluation.run_info import now
from drafttrain.export.writer import export_draft
from drafttrain.runfolder import RunFolder, exported_or_imported, read_json, write_text_atomic
from drafttrain.serving.agreement import compare
from drafttrain.serving.bench import BenchInputs, Draft, our_side, serve_and_sweep, served_formats, servers_for
from drafttrain.serving.prompts import BenchPrompts, suite_prompts
from drafttrain.serving.sweep import build_levels
from drafttrain.targets import Target
from drafttrain.targets.loading import resolve_model_dir
from drafttrain.targets.partial import load_head
from drafttrain.training.run_log import CheckpointMetrics
from drafttrain.userfiles import make_folder, remove

log = logging.getLogger(__name__)

ENGINE_RECORD = "engine.json"  # beside a checkpoint: what the engine measured of it (a watcher skips it then)
ENGINE_DIR = "engine"  # beside a checkpoint: the servers' logs and the engine's raw figures
PYTHON_VARIABLE = "DRAFTTRAIN_VLLM_PYTHON"


def engine_python(settings: EngineEvalSettings) -> str:
    """The Python the engine runs from: eval.engine_settings.python, else $DRAFTTRAIN_VLLM_PYTHON."""
    python = settings.python or os.environ.get(PYTHON_VARIABLE)
    if not python:
        raise DrafttrainError(f"eval.engine vllm: give eval.engine_settings.python (a Python with vLLM installed, "
                              f"never a drafttrain dependency) or set {PYTHON_VARIABLE}")
    check_exists(ENGINES["vllm"], python)
    return python


def engine_depth(recipe: Recipe) -> int:
    """The chain length the engine drafts: eval.engine_settings.num_speculative_tokens, else eval.depth fitted to
    the draft (refused when that is "auto", or deeper than the draft can fill)."""
    cls = drafter_for(recipe.draft)
    deepest = cls.max_draft_depth(recipe.draft)
    depth = recipe.eval.engine_settings.num_speculative_tokens or recipe.eval.fitted_to(deepest).depth
    if depth == "auto":
        raise DrafttrainError("eval.engine serves a chain of one length and eval.depth is auto: give "
                              "eval.engine_settings.num_speculative_tokens")
    if deepest is not None and depth > deepest:
        raise DrafttrainError(f"eval.engine_settings.num_speculative_tokens {depth} is deeper than this "
                              f"{recipe.draft.kind} draft can fill ({deepest})")
    return depth


def check_format(recipe: Recipe) -> None:
    """A format the recipe names for the engine is one of the draft kind's, and one the engine reads."""
    fmt, cls = recipe.eval.engine_settings.format, drafter_for(recipe.draft)
    codecs = codecs_of(cls)
    if fmt is None:
        return
    if fmt not in codecs:
        raise DrafttrainError(f"eval.engine_settings.format {fmt!r}: a {recipe.draft.kind} draft is written in "
                              f"{', '.join(codecs) or 'no format'}")
    if "vllm" not in codecs[fmt].engines:
        served = [f for f, codec in codecs.items() if "vllm" in codec.engines]
        raise DrafttrainError(f"eval.engine_settings.format {fmt!r}: vLLM does not serve it (it serves "
                              f"{', '.join(served) or 'none of this kind'})")


def check_engine(recipe: Recipe) -> None:
    """Everything the engine's evaluation needs that can be checked before any work: its Python, a fixed chain
    length, the format, and (in a prepared run) held-out prompts to send. (The engine's version is asked once the
    run starts, and whether it serves the draft as configured once the draft is built.)"""
    settings, run = recipe.eval.engine_settings, RunFolder.of(recipe.output_dir)
    engine_python(settings)
    engine_depth(recipe)
    check_format(recipe)
    if run.train_split.is_dir() and not run.validation_prompts.is_file():
        raise DrafttrainError(f"eval.engine measures checkpoints on held-out prompts and {run.validation_prompts} is "
                              "missing: set data.validation_fraction > 0 and prepare again")


def served_format(drafter, settings: EngineEvalSettings) -> str | None:
    """The format the engine serves this draft from (None: the engine serves none it is written in)."""
    formats = served_formats(drafter, ENGINES["vllm"])
    if settings.format is None:
        return formats[0] if formats else None
    return settings.format if settings.format in formats else None


def generation_config(target: Target, target_dir: str):
    """The generation config the server reads from the target's folder (its stop tokens), else the model's."""
    if (Path(target_dir) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(target_dir)
    return target.model.generation_config


@dataclasses.dataclass
class EngineSetup:
    """What every checkpoint's measurement shares, settled once: the engine, its Python and version, the target's
    folder, the held-out prompts as the server is sent them, the chain length and the bench settings."""

    recipe: Recipe
    engine: Engine
    python: str
    version: str
    target_dir: str
    prompts: BenchPrompts
    depth: int
    bench: BenchConfig

    @classmethod
    def of(cls, recipe: Recipe, target: Target) -> "EngineSetup":
        settings, engine = recipe.eval.engine_settings, ENGINES["vllm"]
        python = engine_python(settings)
        chosen = selection_prompts(recipe, settings.num_prompts)
        if chosen is None:
            raise DrafttrainError(f"no held-out prompts in {recipe.output_dir} (data/validation_prompts.jsonl): the "
                                  "engine has nothing to measure checkpoints on; set data.validation_fraction > 0 "
                                  "and prepare again")
        target_dir = resolve_model_dir(recipe.target.model)
        prompts = suite_prompts(target.tokenizer, generation_config(target, target_dir), chosen)
        return cls(recipe, engine, python, check_python(engine, python), target_dir, prompts, engine_depth(recipe),
                   bench_settings(settings, engine_depth(recipe), len(prompts.ids), _dtype(recipe)))


def _dtype(recipe: Recipe) -> str:
    dtype = recipe.eval.engine_settings.dtype
    return recipe.target.dtype if dtype == "auto" else dtype


def bench_settings(settings: EngineEvalSettings, depth: int, prompts: int, dtype: str) -> BenchConfig:
    """The engine's settings as bench's: one level, one stream, every prompt once, greedy."""
    parallel = Parallelism(settings.tensor_parallel_size, settings.pipeline_parallel_size,
                           settings.data_parallel_size, settings.expert_parallel)
    return BenchConfig(engine="vllm", concurrency=[1], num_speculative_tokens=[depth], min_requests=prompts,
                       requests_per_stream=1, output_len=settings.max_new_tokens, temperature=0.0,
                       agreement_tolerance=settings.agreement_tolerance, memory_fraction=settings.memory_fraction,
                       port=settings.port, dtype=dtype, server_args=[*parallel.args(), *settings.server_args],
                       startup_timeout_s=settings.startup_timeout_s)


@contextlib.contextmanager
def exported(checkpoint: Path, fmt: str, target: Target) -> Iterator[Path]:
    """The checkpoint exported in ``fmt`` into a scratch folder outside the run (an export into the run would wait
    for the run's lock, which a running trainer holds), removed once the engine has served it."""
    scratch = Path(tempfile.mkdtemp(prefix="drafttrain-engine-"))
    export = scratch / "draft"
    try:
        yield export_draft(checkpoint, fmt, export, target)
    finally:
        remove(export, "the export the engine served (a copy of the checkpoint's weights)", inside=export,
               made=exported_or_imported)
        remove(scratch, "the engine's scratch folder, empty")


def free_ports(settings: EngineEvalSettings) -> None:
    busy = [port for port in (settings.port, settings.port + 1) if port_in_use(port)]
    if busy:
        raise DrafttrainError(f"port {busy[0]} is in use (another server?): set eval.engine_settings.port to a free "
                              "one (the engine's two servers take it and the next)")


def measure(setup: EngineSetup, checkpoint: Path, drafter, fmt: str, target: Target) -> dict[str, Any]:
    """Serve ``checkpoint`` (``drafter`` loaded from it) in the engine against plain serving on the held-out prompts;
    returns its record. The servers' logs and the raw figures are written beside the checkpoint (``step-N.engine.tmp``,
    so a checkpoint pruned meanwhile is not made again by them) and moved into CHECKPOINT/engine/ at the end."""
    free_ports(setup.recipe.eval.engine_settings)
    out = work_folder(checkpoint)
    with exported(checkpoint, fmt, target) as export:
        draft = Draft(checkpoint.name, codecs_of(type(drafter))[fmt].serving(drafter), export, checkpoint, drafter,
                      drafter.identity()["weights_sha256"])
        sides = servers_for([draft], setup.bench, setup.engine, BenchInputs([], None, setup.python),
                            setup.target_dir, out)
        serve_and_sweep(sides, setup.bench, setup.engine, setup.python, setup.target_dir, setup.prompts, out)
    (level,) = build_levels(setup.engine, out)
    plain, drafted = level["sides"][PLAIN], level["sides"][sides[1].label]
    metrics = {"engine_speedup": drafted["speedup"]}
    if drafted.get("acceptance_length") is not None:
        metrics["engine_tau"] = drafted["acceptance_length"]
        metrics.update({f"engine_acceptance_{k}": v for k, v in enumerate(drafted["acceptance_per_position"], 1)})
    record = {"checkpoint": checkpoint.name, "measured_at": now(), "format": fmt, "side": sides[1].label,
              "engine": {"name": setup.engine.name, "version": setup.version},
              "num_speculative_tokens": setup.depth, "settings": setup.recipe.eval.engine_settings.model_dump(),
              "prompts": {"source": setup.prompts.source, "count": len(setup.prompts.ids)},
              "plain": _public(plain), "draft": _public(drafted), "metrics": metrics,
              "errors": [] if "engine_tau" in metrics else ["the engine counted no draft: no acceptance measured"]}
    settle(out, checkpoint)
    return record


def work_folder(checkpoint: Path) -> Path:
    """A fresh scratch folder beside the checkpoint for the engine's files (a trainer's next start removes one an
    interrupted measurement left, as it removes every ``.tmp``)."""
    work = checkpoint.with_name(f"{checkpoint.name}.engine.tmp")
    remove(work, "the engine's files of an interrupted measurement")
    return make_folder(work, "the engine's figures of the checkpoint")


def settle(work: Path, checkpoint: Path) -> None:
    """The engine's files into CHECKPOINT/engine/ (replacing an earlier measurement's); a checkpoint pruned while it
    was measured is an error naming it (FileNotFoundError)."""
    final = checkpoint / ENGINE_DIR
    if final.exists():
        remove(final, "the engine's files of an earlier measurement of this checkpoint",
               inside=checkpoint.parent.parent, made=RunFolder.made)
    if not checkpoint.is_dir():
        remove(work, "the engine's files of a checkpoint pruned while it was measured")
        raise FileNotFoundError(checkpoint)
    os.replace(work, final)


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """A level's row without the answers' text (the prompts are the user's data; the raw files keep them)."""
    return {k: v for k, v in row.items() if k != "generated_texts"}


def agreement_of(setup: EngineSetup, checkpoint: Path, drafter, target: Target) -> dict[str, Any]:
    """drafttrain's evaluator on the prompts the engine measured ``checkpoint`` on (the whole ``target`` in this
    process, ``drafter`` loaded from the checkpoint), against the engine's figures in CHECKPOINT/engine/: bench's
    agreement row, with ``error`` when the two τ differ by more than the tolerance."""
    (level,) = build_levels(setup.engine, checkpoint / ENGINE_DIR)
    label = next(name for name in level["sides"] if name != PLAIN)
    draft = Draft(checkpoint.name, {}, drafter=drafter)
    ours = our_side(draft, target, setup.prompts, setup.bench, setup.depth)
    row, error = compare(label, level["sides"][label], ours, setup.bench.agreement_tolerance)
    return {**row, "error": error}


def record_path(checkpoint: Path) -> Path:
    return checkpoint / ENGINE_RECORD


def read_record(checkpoint: Path) -> dict[str, Any] | None:
    path = record_path(checkpoint)
    return read_json(path) if path.is_file() else None


def write_record(checkpoint: Path, record: dict[str, Any]) -> None:
    write_text_atomic(record_path(checkpoint), json.dumps(record, indent=1))


class EngineCheckpoints:
    """``fn(step, checkpoint) -> CheckpointMetrics``: the engine's figures of each checkpoint (``engine_tau``,
    ``engine_acceptance_k``, ``engine_speedup``, and where the target is whole here ``agreement_difference``), its
    record written beside it. The trainer's callback with eval.engine_settings.inline, and ``drafttrain watch``'s
    measure.

    ``target``: the target this process holds whole, or its head (capture engines run its layers), or None when it
    is partitioned (ZeRO-3): its head is then loaded here, once, to export checkpoints with. ``whole``: whether
    drafttrain's evaluator can decode here (the agreement, and the fallback). ``own_evaluator``: drafttrain's
    evaluator measures every checkpoint already (eval.every_checkpoint), so a fallback adds nothing of its own."""

    def __init__(self, recipe: Recipe, target: Target | None, whole: bool, own_evaluator: bool = False):
        self.recipe, self.settings, self.whole, self.own_evaluator = \
            recipe, recipe.eval.engine_settings, whole, own_evaluator
        self._target = target
        self._setup: EngineSetup | None = None
        self._fallback_said = False

    def target(self) -> Target:
        if self._target is None:  # partitioned over the training processes: the head is enough to export
            log.info("loading the target's head (its layers stay partitioned) to export checkpoints for the engine")
            self._target = load_head(self.recipe.target)
        return self._target

    def setup(self) -> EngineSetup:
        if self._setup is None:
            self._setup = EngineSetup.of(self.recipe, self.target())
        return self._setup

    def __call__(self, step: int, checkpoint: Path) -> CheckpointMetrics:
        target = self.target()
        drafter = load_drafter(checkpoint, target).eval()
        fmt = served_format(drafter, self.settings)
        measured = CheckpointMetrics({})
        if fmt is None:
            record = self._fall_back(step, checkpoint, drafter, measured)
        else:
            record = measure(self.setup(), checkpoint, drafter, fmt, target)
            self._agree(checkpoint, drafter, record)
        record["step"] = step
        write_record(checkpoint, record)
        _say(step, record)
        measured.merge(record["metrics"])
        return measured

    def agree_later(self, checkpoint: Path) -> CheckpointMetrics:
        """drafttrain's evaluator on a checkpoint the engine measured without it (by a trainer under ZeRO-3, say),
        its record completed: the agreement's figures (this process holds the whole target)."""
        record = read_record(checkpoint)
        drafter = load_drafter(checkpoint, self.target()).eval()
        record.update(errors=[e for e in record.get("errors", []) if "differs from drafttrain" not in e])
        self._agree(checkpoint, drafter, record)
        write_record(checkpoint, record)
        _say(record.get("step", 0), record)
        return CheckpointMetrics({k: v for k, v in record["metrics"].items() if k.startswith("agreement_")})

    def _agree(self, checkpoint: Path, drafter, record: dict[str, Any]) -> None:
        if not self.whole:
            record["agreement"] = {"skipped": "the target is not whole in this process (ZeRO-3 partitions it, or "
                                              "capture engines run its layers): drafttrain's evaluator did not decode"}
            return
        if "engine_tau" not in record["metrics"]:
            return
        row = agreement_of(self.setup(), checkpoint, drafter, self.target())
        record["agreement"] = row
        figures = {"agreement_difference": row["difference"], "agreement_drafttrain_tau": row["drafttrain_tau"]}
        record["metrics"].update({k: v for k, v in figures.items() if v is not None})
        if row["error"]:
            record["errors"].append(row["error"])

    def _fall_back(self, step: int, checkpoint: Path, drafter, measured: CheckpointMetrics) -> dict[str, Any]:
        """A draft the engine serves from none of its formats: drafttrain's evaluator where the target is whole here
        (unless it measures every checkpoint already), else the held-out accuracy alone."""
        why = (f"vLLM serves no format this {drafter.kind} draft is written in "
               f"({', '.join(drafter.export_formats()) or 'none'})" if self.settings.format is None else
               f"this {drafter.kind} draft is not written in eval.engine_settings.format {self.settings.format!r}")
        instead = ("drafttrain's own evaluator measures its checkpoints" if self.whole else
                   "its checkpoints get held-out accuracy only (the target is not whole in this process)")
        if not self._fallback_said:
            log.warning("eval.engine vllm: %s, so %s", why, instead)
            self._fallback_said = True
        if self.whole and not self.own_evaluator:
            measured.merge(CheckpointEvaluator(self.recipe, self.target())(step, checkpoint))
        return {"checkpoint": checkpoint.name, "measured_at": now(), "fallback": f"{why}: {instead}",
                "metrics": {"engine_fallback": 1.0}, "errors": []}


def _say(step: int, record: dict[str, Any]) -> None:
    metrics = record["metrics"]
    if "fallback" in record:  # said once, when the first checkpoint fell back
        return
    if "engine_tau" not in metrics:
        log.warning("step %d: %s", step, "; ".join(record["errors"]) or "the engine measured no acceptance")
        return
    per = ", ".join(f"{metrics[f'engine_acceptance_{k}']:.2f}" for k in range(1, len(metrics))
                    if f"engine_acceptance_{k}" in metrics)
    ours = "" if metrics.get("agreement_difference") is None else \
        f"; drafttrain's evaluator τ {metrics['agreement_drafttrain_tau']:.3f} (difference " \
        f"{metrics['agreement_difference']:+.3f})"
    log.info("step %d: engine τ %.3f (acceptance per position %s), %.2fx plain serving's speed%s", step,
             metrics["engine_tau"], per, metrics["engine_speedup"], ours)
    for error in record["errors"]:
        log.warning("step %d: %s", step, error)
