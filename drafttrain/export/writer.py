"""``drafttrain export``: a checkpoint in a serving engine's format, with its model card, written all or nothing.

The folder holds config.json and model.safetensors in the engine's layout (or a whole HF model folder), any
sub-folder the kind brings (Medusa-2's merged target), the model card (README.md) with the measured eval table and
its acceptance plot, and a manifest of every file with what it was built from. The config keeps a ``drafttrain``
section that engines ignore, so the export loads back (``drafttrain eval --draft EXPORT``) and measures the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.data.traffic import redacted
from drafttrain.drafts import load_drafter
from drafttrain.drafts.base import Drafter
from drafttrain.drafts.codecs import codecs_of, refused, writable_formats
from drafttrain.drafts.registry import known_formats
from drafttrain.drafts.saved import SavedDraft
from drafttrain.evaluation.evaluate import EvalReport
from drafttrain.evaluation.report import ACCEPTANCE_PLOT, CONTEXT_PLOT, plot_acceptance, plot_by_context
from drafttrain.evaluation.serving_report import PLOT_NAME as BENCH_PLOT
from drafttrain.evaluation.serving_report import plot as plot_bench
from drafttrain.export.card import build_card
from drafttrain.runfolder import (
    CONFIG_NAME,
    EVAL_DIR,
    MANIFEST,
    WEIGHTS_NAME,
    RunFolder,
    RunLock,
    exported_or_imported,
    read_json,
    write_manifest,
    write_text_atomic,
)
from drafttrain.targets import Target, load_target
from drafttrain.userfiles import make_folder, remove, writing

REPORT_NAME = "report.json"
BENCH_DIR = "bench"  # drafttrain bench leaves its sweep's report here, beside the checkpoint it served


def recorded_target(saved: SavedDraft) -> str:
    """The target a saved draft was trained for; refused when it does not record one."""
    if saved.target_name is None:
        raise DrafttrainError(f"{saved.directory} does not record the target it was trained for: pass --target")
    return saved.target_name


def export_checkpoint(source: str | Path | SavedDraft, fmt: str | None, out: str | Path | None,
                      target_name: str | None = None, device: str = "cpu", **options) -> Path:
    """``export_draft`` for the commands: the draft at ``source`` with the target it was trained for (or
    ``target_name``), in ``fmt`` (default: the first it can be written in), to ``out`` (default: the run's
    ``exports/<fmt>``, replaced)."""
    saved = SavedDraft.open(source)
    if out is not None:  # a folder that may not be replaced is refused before the target loads
        staging_for(Path(out), bool(options.get("overwrite")), saved.directory, check_only=True)
    target = load_target(target_name or recorded_target(saved), device=device)
    drafter = load_drafter(saved, target, as_saved=True)
    # the draft as configured says which formats it can be written in (a P-EAGLE head: speculators' only)
    fmt = fmt or writable_formats(drafter)[0]
    if out is None:
        checkpoint = saved.directory
        out, options["overwrite"] = (RunFolder.of_checkpoint(checkpoint) or RunFolder.of(checkpoint)).export(fmt), True
    return export_draft(saved, fmt, out, target, **options, loaded=drafter)


def export_draft(source: str | Path | SavedDraft, fmt: str, out: str | Path, target: Target, overwrite: bool = False,
                 report: str | Path | None = None, verifier: str | None = None, loaded: Drafter | None = None) -> Path:
    """Write the draft at ``source`` (a checkpoint, or a run: its best checkpoint) in format ``fmt`` to ``out``.

    The card's eval table is ``report`` (a report.json from ``drafttrain eval``) or the checkpoint's own
    evaluation; either must have measured these very weights. An existing non-empty ``out`` is refused unless
    ``overwrite``; the folder is built beside it and moved into place only when complete. ``verifier``: the
    target's path or Hub id as the speculators config names it (default: its Hub id where known, else its folder).
    ``loaded``: the draft at ``source`` already loaded as saved (``as_saved``), so it is not loaded again."""
    if fmt not in known_formats():
        raise DrafttrainError(f"unknown export format {fmt!r}; formats: {', '.join(known_formats())}")
    out, saved = Path(out), SavedDraft.open(source)
    checkpoint = saved.directory
    run = RunFolder.holding(out)  # an export into a run folder (push's <run>/exports/<format>) waits for no one
    with RunLock(run.root, "drafttrain export") if run is not None else contextlib.nullcontext():
        staging = staging_for(out, overwrite, checkpoint)
        drafter = loaded if loaded is not None else load_drafter(saved, target, as_saved=True)
        refusal = refused(drafter, fmt)
        if refusal is not None:
            raise DrafttrainError(refusal)
        measured = _measured(drafter, checkpoint, report)
        make_folder(staging, "the export's staging folder")  # beside --out: a read-only place fails here
        with writing(out, "the export", after="; nothing was replaced: make room and export again"), \
                _removed_on_failure(staging):
            _write_export(drafter, fmt, staging, checkpoint, measured, verifier)
            publish(staging, out)
    return out


@contextlib.contextmanager
def _removed_on_failure(staging: Path):
    """A half-built export is not left behind (its room is what a full disk lacks)."""
    try:
        yield
    except BaseException:
        remove(staging, "the half-built export of this failed run")
        raise


def _write_export(drafter, fmt: str, staging: Path, checkpoint: Path, measured, verifier: str | None) -> None:
    """Every file of the export into ``staging``: the draft in ``fmt``, its sub-folders, the measured report and
    plots, the bench, the card and the manifest."""
    exported = codecs_of(type(drafter))[fmt].write(drafter)
    if verifier is not None and "speculators_config" in exported.config:
        exported.config["speculators_config"]["verifier"]["name_or_path"] = verifier
    _write_draft(exported, staging)
    for name, write in exported.folders.items():
        if name:
            write(staging / name)
    built_from = read_json(checkpoint / MANIFEST)["built_from"] if (checkpoint / MANIFEST).is_file() else {}
    if measured is not None:
        (staging / EVAL_DIR).mkdir()
        write_text_atomic(staging / EVAL_DIR / REPORT_NAME, json.dumps(measured, indent=1))
        report = EvalReport(**measured)
        plot_acceptance(report, staging / ACCEPTANCE_PLOT)
        if report.overall.get("by_context"):
            plot_by_context(report, staging / CONTEXT_PLOT)
    bench = _bench(drafter, checkpoint)
    if bench is not None:
        (staging / BENCH_DIR).mkdir()
        write_text_atomic(staging / BENCH_DIR / REPORT_NAME, json.dumps(bench, indent=1))
        plot_bench(bench, staging / BENCH_PLOT)
    card = build_card(drafter, fmt, exported, measured, redacted(built_from.get("recipe")),
                      plot=ACCEPTANCE_PLOT if measured is not None else None, bench=bench)
    # what `push` uploads: a key pasted into the recipe (or a path) leaves the machine redacted, as logs do
    write_text_atomic(staging / "README.md", redacted(str(card)))
    # the card is left out of the checksums: editing it is the usual step before publishing
    write_manifest(staging, redacted({"checkpoint": str(checkpoint), "format": fmt, **drafter.identity(),
                                      **{k: v for k, v in built_from.items() if k != "recipe"}}), skip=("README.md",))


def staging_for(out: Path, overwrite: bool, source: Path | None = None, check_only: bool = False) -> Path:
    """Where to build the folder ``out`` (beside it, emptied; ``publish`` moves it into place only when complete).
    An existing non-empty ``out`` is refused unless ``overwrite``, and then unless it is a draft folder `drafttrain
    export` or `import` wrote that is not the draft being written (``source``) nor holds it."""
    if out.exists() and not out.is_dir():
        raise DrafttrainError(f"--out {out} is a file, not a folder: choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise DrafttrainError(f"{out} exists and is not empty: choose another --out, or pass --overwrite")
        why = _not_replaceable(out, source)
        if why is not None:
            raise DrafttrainError(f"--out {out} cannot be replaced (--overwrite): {why}; nothing was changed, "
                                  "choose another --out")
    staging = out.with_name(out.name + ".partial")
    if not check_only:
        remove(staging, "an unfinished export an interrupted run left")
    return staging


def _not_replaceable(out: Path, source: Path | None) -> str | None:
    """Why --overwrite may not replace ``out`` (None: an earlier export or import, not holding ``source``)."""
    real = out.resolve()
    if source is not None:
        draft = source.resolve()
        run = RunFolder.of_checkpoint(draft)
        if draft.is_relative_to(real) or real.is_relative_to(draft):
            return f"it is or holds the draft being exported ({source})"
        if run is not None and real.is_relative_to(run.root) and not real.is_relative_to(run.root / "exports"):
            return f"it is in the run being exported ({run.root}), not in its exports/ folder"
    if RunFolder.made(real) or RunFolder(real).earlier_run():
        return "it is a run folder"
    if not exported_or_imported(real):
        return ("it is not a folder `drafttrain export` or `drafttrain import` wrote (no manifest.json naming a "
                "format or an import)")
    return None


def publish(staging: Path, out: Path) -> None:
    """Move the complete ``staging`` folder to ``out``, replacing an earlier export or import there."""
    remove(out, "the earlier export --overwrite replaces", inside=out, made=exported_or_imported)
    staging.rename(out)


def _write_draft(exported, folder: Path) -> None:
    """config.json + model.safetensors, or a whole HF model folder whose config gains the drafttrain section."""
    if "" in exported.folders:
        exported.folders[""](folder)
        config = {**json.loads((folder / CONFIG_NAME).read_text()), **exported.config}
    else:
        tensors = {k: v.contiguous() for k, v in exported.tensors.items()}
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        config = exported.config
    write_text_atomic(folder / CONFIG_NAME, json.dumps(config, indent=2))


def _bench(drafter: Drafter, checkpoint: Path) -> dict[str, Any] | None:
    """The serving sweep beside the checkpoint, when one of its sides served these very weights."""
    path = checkpoint / BENCH_DIR / REPORT_NAME
    if not path.is_file():
        return None
    bench = read_json(path)
    sha = drafter.identity()["weights_sha256"]
    if not any(side.get("weights_sha256") == sha for side in bench.get("sides", [])):
        logging.getLogger(__name__).warning("%s served other weights than %s: left off the card", path, checkpoint)
        return None
    return bench


def _measured(drafter: Drafter, checkpoint: Path, report: str | Path | None) -> dict[str, Any] | None:
    """The eval report for the card: given, or the checkpoint's own; refused when it measured other weights."""
    path = Path(report) if report is not None else checkpoint / EVAL_DIR / REPORT_NAME
    if not path.is_file():
        if report is not None:
            raise DrafttrainError(f"--report {path} does not exist")
        return None
    measured = read_json(path)
    recorded = (measured.get("config") or {}).get("draft") or {}
    sha = drafter.identity()["weights_sha256"]
    if recorded.get("weights_sha256") not in (None, sha) or (report is not None and recorded.get("weights_sha256")
                                                              is None):
        raise DrafttrainError(f"{path} measured other weights than {checkpoint} (sha256 "
                              f"{recorded.get('weights_sha256')} vs {sha}): evaluate this checkpoint "
                              "(`drafttrain eval --draft ...`) and pass that report")
    return measured
