"""``drafttrain eval``: speculative decoding vs plain decoding on a question suite; writes report.json/.md/.png.

Cheap inputs (suite, numbers, draft path, proposer name) are checked before the target loads, so a typo fails in
a second, not after a model load. Exit codes: 0 ok, 2 bad input (message names the cause), 1 ``--strict`` and the
greedy output differs from the baseline at T=0.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import ValidationError

from drafttrain import DrafttrainError
from drafttrain.commands.schema_flags import FlagExtras, add_schema_flags, flag_of, given_values
from drafttrain.config import DecodeSettings, EvalConfig, describe_errors
from drafttrain.cpu_linear import cpu_linear_mode
from drafttrain.decoding import PROPOSERS
from drafttrain.decoding.proposers import model_folder_proposer, trained_draft
from drafttrain.decoding.trees import check_tree_depth, tree_of
from drafttrain.drafts import load_drafter
from drafttrain.drafts.foreign import foreign_draft
from drafttrain.drafts.saved import SavedDraft
from drafttrain.evaluation.checkpoint_eval import CALIBRATION_PROMPTS
from drafttrain.evaluation.evaluate import evaluate
from drafttrain.evaluation.report import print_report, write_report
from drafttrain.evaluation.sides import Compared
from drafttrain.evaluation.suites import Suite, load_suite, served_kind, without_reported
from drafttrain.runfolder import CONFIG_NAME, RunFolder, read_json
from drafttrain.targets import BUILTIN_TARGETS, Target, load_target

log = logging.getLogger(__name__)

FEEDBACK_FILE = "feedback.jsonl"
DTYPES = ("float32", "bfloat16", "float16", "auto")
# The eval section's fields that are flags (the others, every_checkpoint and the budget, are for training runs).
PROMPT_FIELDS = ("suite", "num_prompts")
DECODE_FIELDS = tuple(DecodeSettings.model_fields)
FLAG_EXTRAS = {
    "num_prompts": FlagExtras(none_word="all"),
    "depth": FlagExtras(aliases=("-k",), note="a default depth the draft cannot fill is lowered to its deepest; "
                                              "auto calibrates on the --calibration prompts"),
}
# The schema field a flag fills, where the flag is not named after it (the others: max_new_tokens -> --max-new-tokens).
FLAG_OF = {"suite": "--suite / --questions"}
DYNAMIC_TREE_FIELDS = ("total_tokens", "tree_top_k")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: built-in name, folder, .gguf or Hub id")
    parser.add_argument("--proposer", help=f"proposer name: {', '.join(PROPOSERS)} (default: the one "
                                           "that serves the --draft checkpoint's kind)")
    parser.add_argument("--draft", help="a drafttrain checkpoint or run folder, or a draft model (built-in name, "
                                        f"folder, .gguf) for the {model_folder_proposer()} proposer")
    prompts = parser.add_mutually_exclusive_group()
    add_schema_flags(prompts, EvalConfig, PROMPT_FIELDS[:1])
    prompts.add_argument("--questions", help="FastChat-format .jsonl (question_id, category, turns) instead of a suite")
    parser.add_argument("--out", required=True, help="output folder for report.json, report.md, acceptance.png")
    add_schema_flags(parser, EvalConfig, PROMPT_FIELDS[1:], FLAG_EXTRAS)
    parser.add_argument("--turns", choices=("1", "all"), default="all", help="ask only the first turn, or all turns")
    parser.add_argument("--calibration", help="prompts for --depth auto (a suite name or FastChat .jsonl); default: "
                                              "the suite's own prompts that are not reported, else the draft run's "
                                              "held-out validation prompts, else another suite")
    decoding = parser.add_argument_group("decoding (the fields of a recipe's eval section)")
    add_schema_flags(decoding, DecodeSettings, DECODE_FIELDS, FLAG_EXTRAS)
    for name, section in _settings_sections().items():
        add_schema_flags(parser.add_argument_group(f"the {name} proposer (--proposer {name}, --compare {name})"),
                         section, section.model_fields)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hf-reference", action="store_true",
                        help="also time HF model.generate (plain, and prompt lookup / assisted to match the proposer)")
    parser.add_argument("--compare", action="append", default=[], type=CompareSpec.parse, metavar=CompareSpec.FORM,
                        help="also run another side on the same prompts in the same run, against the same baseline: "
                             "a draft-free proposer (prompt_lookup, lookahead), a trained draft's checkpoint/run folder, or a "
                             "plain model folder (served as a draft model, as --draft serves one); @SHAPE gives it its "
                             "own chain depth (@3, @auto) or tree (@tree:medusa-16, @tree:auto); LABEL= names it in the "
                             "report (default: the proposer or the folder's name); repeatable")
    parser.add_argument("--draft-vocab", metavar="FILE|none",
                        help=f"{model_folder_proposer()} proposer: draft only from this draft vocabulary (a "
                             "draft_vocab.safetensors "
                             "from `drafttrain prepare`; its lm_head rows alone are computed), or 'none' for the whole "
                             "vocabulary (default: a drafttrain draft model's own, else the whole)")
    parser.add_argument("--feedback", action="store_true",
                        help="also write OUT/feedback.jsonl: the method's prompts and answers with the positions where "
                             "the target refused its draft, a request log for `prepare` (format request_log; "
                             "rejected_weight weighs those positions up): the closed loop. Feed back your own "
                             "traffic's prompts (--questions), not the prompts you measure on")
    parser.add_argument("--strict", action="store_true", help="exit 1 if greedy output differs from the baseline")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is far steadier on a busy shared CPU)")
    parser.add_argument("--cpu-linear", choices=("packed", "default"), default=None,
                        help="linear layers on a CPU: oneDNN with pre-packed weights (default; much cheaper for the "
                             "few-token forwards of verification) or PyTorch's own kernel; every side of the run "
                             "uses the same (env DRAFTTRAIN_CPU_LINEAR)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class CompareSpec:
    """One ``--compare`` as written, parsed by argparse (``type=``): a draft-free proposer's name or a draft folder
    (``source``), the report's name for it (``label``; None: the default), and its own shape (``shape``: a chain
    depth such as ``3`` or ``auto``, or ``tree:SPEC``; "": the run's). What the source names is resolved in run()."""

    source: str
    label: str | None = None
    shape: str = ""
    shape_given: bool = False  # an "@" was written (a bare "@" gives an empty shape that check_shape refuses)
    FORM: ClassVar[str] = "[LABEL=]PROPOSER_OR_DRAFT[@SHAPE]"

    @classmethod
    def parse(cls, text: str) -> "CompareSpec":
        label, named, rest = text.partition("=")
        # LABEL= only where the text before "=" cannot be a path (a folder may have "=" in its name)
        if not named or "/" in label or "@" in label or Path(text.partition("@")[0]).expanduser().exists():
            label, rest = None, text
        elif not label:
            raise argparse.ArgumentTypeError(f"{text}: the LABEL before '=' is empty (name the side, or leave out '=')")
        source, at, shape = rest.partition("@")
        if not source:
            raise argparse.ArgumentTypeError(f"{text}: no proposer or draft folder (expected {cls.FORM})")
        return cls(source, label, shape, shape_given=bool(at))

    def check_shape(self) -> None:
        """A shape given must be a depth or a tree (checked in run(), so the error goes the way of the others)."""
        if self.shape_given and self.depth is None and self.tree is None:
            raise DrafttrainError(f"--compare {self}: @{self.shape} is neither a depth (@3, @auto) nor a tree "
                                  "(@tree:...)")

    @property
    def depth(self) -> int | str | None:
        if self.shape == "auto":
            return self.shape
        is_count = self.shape.isascii() and self.shape.isdigit() and int(self.shape) > 0
        return int(self.shape) if is_count else None

    @property
    def tree(self) -> str | None:
        return (self.shape.removeprefix("tree:") or None) if self.shape.startswith("tree:") else None

    @property
    def suffix(self) -> str:
        """``@SHAPE`` as written, or "" for the run's shape."""
        return f"@{self.shape}" if self.shape_given else ""

    def __str__(self) -> str:
        return (f"{self.label}=" if self.label is not None else "") + self.source + self.suffix


def run(args: argparse.Namespace) -> int:
    settings = eval_settings(args)
    suite = load_suite(settings.suite).select(settings.num_prompts, turns=args.turns)
    tree_of(settings)  # a bad tree spec fails now, before the target loads
    saved = _saved_draft(args.draft, args.target)
    proposer = _checked_proposer(args, saved)
    sides = [_compared_side(spec, settings, args.target) for spec in args.compare]
    own = _proposer_settings(args, {proposer, *(side.spec.source for side in sides if side.serves == "proposer")})
    run_settings = settings  # as given: a compared proposer's default depth is fitted from it too
    settings = settings.fitted_to(saved.max_depth() if saved is not None
                                  else PROPOSERS[proposer].deepest(**own.get(proposer, {})))
    autos = [settings.depth, settings.tree, *(s for side in sides for s in (side.spec.depth, side.spec.tree))]
    calibration = _calibration(args, suite) if "auto" in autos else ()
    _prepare_out_dir(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    if saved is not None:
        # a drafttrain draft: loaded (and checked) here, so the report records which weights it measured
        method, method_kwargs = trained_draft(proposer, target, load_drafter(saved, target)), {}
    else:
        method, method_kwargs = proposer, {**_proposer_kwargs(args, proposer), **own.get(proposer, {})}
    if args.draft_vocab is not None:
        method_kwargs["vocab"] = False if args.draft_vocab == "none" else args.draft_vocab
    report = evaluate(target, method, suite, settings.decode_settings(), calibration=calibration,
                      hf_reference=args.hf_reference, progress=not args.no_progress, proposer_kwargs=method_kwargs,
                      compare=[_load_compared(side, target, own, run_settings) for side in sides],
                      cpu_linear=args.cpu_linear,
                      feedback=Path(args.out) / FEEDBACK_FILE if args.feedback else None)
    paths = write_report(report, args.out)
    print_report(report)
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return _greedy_verdict(report.greedy_match, settings.temperature, args.strict)


def eval_settings(args: argparse.Namespace) -> EvalConfig:
    """The flags as the recipe's typed eval section, validated there; an error names the flag. Only the flags given
    are set, so the section knows them from its defaults. CLI-only inputs (the CPU kernels, threads) are checked
    here."""
    cpu_linear_mode(args.cpu_linear)  # a bad DRAFTTRAIN_CPU_LINEAR fails here, before the target loads
    if args.threads is not None and args.threads <= 0:
        raise DrafttrainError(f"--threads must be positive, got {args.threads}")
    values = given_values(args, (*PROMPT_FIELDS, *DECODE_FIELDS))
    if args.questions:
        values["suite"] = args.questions
    try:
        settings = EvalConfig.model_validate(values)
    except ValidationError as err:
        flag = lambda loc: FLAG_OF.get(loc[0], flag_of(loc[0])) if loc else ""  # noqa: E731
        raise DrafttrainError(describe_errors(err, flag)) from None
    _flags_that_act(settings)
    return settings


def _flags_that_act(settings: EvalConfig) -> None:
    """Refuse a flag that cannot act on the run it is given for, rather than let it do nothing (and the report
    record it as if it had): sampling's --top-p and --top-k at temperature 0, a --depth beside a static tree. --top-k
    once set the dynamic tree's expansion (now --tree-top-k): a user who gives it at temperature 0 most likely means
    the old flag."""
    given = [flag_of(field) for field in DYNAMIC_TREE_FIELDS if field in settings.model_fields_set]
    if given and settings.tree != "dynamic":
        raise DrafttrainError(f"{' and '.join(given)}: flags that shape the dynamic tree (--tree dynamic) and cannot "
                              f"act on --tree {settings.tree} (--tree-top-k is the tree's expansion, not sampling's "
                              "top-k: that is --top-k)")
    check_tree_depth(settings)
    if settings.top_p < 1 and settings.temperature == 0:
        raise DrafttrainError(f"--top-p {settings.top_p} is sampling's nucleus, which cannot act at temperature 0 "
                              "(greedy decoding): give --temperature above 0 to sample")
    if settings.top_k > 0 and settings.temperature == 0:
        cannot = f"--top-k {settings.top_k} is sampling's top-k, which cannot act at temperature 0 (greedy decoding)"
        if settings.tree == "dynamic":
            raise DrafttrainError(f"{cannot}: the dynamic tree's children per node are --tree-top-k "
                                  f"{settings.top_k}; to sample, give --temperature above 0")
        raise DrafttrainError(f"{cannot}: give --temperature above 0 to sample (the dynamic tree's children per node "
                              "are --tree-top-k)")


def _calibration(args: argparse.Namespace, suite: Suite) -> tuple:
    """Held-out prompts for depth or tree auto: the given ones; else the reported suite's own prompts that are not
    reported (the served kind); else the draft run's validation prompts; else the first prompts of a suite other
    than the one reported."""
    if args.calibration:
        chosen = load_suite(args.calibration)
    elif served_kind(suite, CALIBRATION_PROMPTS):
        return served_kind(suite, CALIBRATION_PROMPTS)
    else:
        draft = Path(args.draft).expanduser() if args.draft else None
        runs = [RunFolder.of(p) for p in ([draft, *list(draft.parents)[:2]] if draft else [])]  # run, or a checkpoint
        held_out_file = next((run.validation_prompts for run in runs if run.validation_prompts.is_file()), None)
        if held_out_file is not None:
            chosen = load_suite(held_out_file)
        else:
            chosen = load_suite("gsm8k" if suite.name == "alpaca" else "alpaca")
    questions = without_reported(chosen.select(turns="1"), suite).questions
    if not questions:
        raise DrafttrainError(f"--calibration {chosen.name}: no prompt left that is not also reported")
    return questions[:CALIBRATION_PROMPTS]


def _prepare_out_dir(out: str) -> None:
    """Create the output folder now, so an unwritable path fails before minutes of decoding, not after."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DrafttrainError(f"cannot create the output folder {out}: {err.strerror}") from None


def _saved_draft(draft: str | None, target: str) -> SavedDraft | None:
    """The --draft when drafttrain saved it (opened once, here: damage is named before the target loads); None for
    no draft, or a plain model folder, built-in name or Hub id. A missing local path is refused, and so is a draft
    another tool wrote (see ``_refuse_foreign``)."""
    if draft and _looks_like_path(draft) and not Path(draft).expanduser().exists():
        raise DrafttrainError(f"draft not found: {draft}")
    if draft:
        _refuse_foreign(draft, target, "--draft")
    return SavedDraft.find(draft) if draft else None


def _refuse_foreign(folder: str, target: str, flag: str) -> None:
    """A draft another tool wrote (speculators, SpecForge, ...) is refused with the command that imports it. Not
    imported on the fly: `drafttrain import` writes a checkpoint with a manifest, checked once against the target,
    that eval, export and train then all take and a report names by its path and weights; an import made inside
    each eval would measure a temporary folder no later command can name, and repeat the import every run."""
    found = foreign_draft(folder)
    if found is not None:
        kind, fmt = found
        imported = str(Path(folder).with_name(Path(folder).name + "-imported"))
        raise DrafttrainError(f"{flag} {folder} is a draft another tool wrote ({kind.kind}, {fmt} format): import "
                              f"it first, then evaluate the import: drafttrain import {shlex.quote(folder)} "
                              f"--target {shlex.quote(target)} --out {shlex.quote(imported)} (and give {flag} "
                              f"{shlex.quote(imported)})")


def _checked_proposer(args: argparse.Namespace, saved: SavedDraft | None) -> str:
    """The proposer named, or without --proposer the one that serves the --draft checkpoint's kind (``saved``);
    checked before the target loads: an unknown name, or a draft that is needed but missing, fails now."""
    known = set(PROPOSERS)
    proposer = args.proposer if args.proposer is not None else _default_proposer(args.draft, saved)
    if proposer not in known:
        raise DrafttrainError(f"unknown proposer {proposer!r}: choose one of {', '.join(sorted(known))}")
    if args.draft and "draft" not in _proposer_options(proposer):
        raise DrafttrainError(f"--draft is not used by proposer {proposer!r} (it needs no draft model)")
    if proposer == model_folder_proposer() and not args.draft:
        raise DrafttrainError(f"proposer {proposer} needs --draft (a draft model: built-in name, folder or .gguf)")
    if args.draft_vocab is not None:
        if proposer != model_folder_proposer():
            raise DrafttrainError(f"--draft-vocab is for the {model_folder_proposer()} proposer, not {proposer!r}")
        if args.draft_vocab != "none" and not Path(args.draft_vocab).is_file():
            raise DrafttrainError(f"--draft-vocab: no such file {args.draft_vocab}")
    return proposer


class Side(NamedTuple):
    """A --compare side resolved: what serves it, and its name in the report."""

    spec: CompareSpec
    label: str  # the label given, else the proposer's or the draft folder's name, with the shape given
    serves: Literal["proposer", "draft", "model_folder"]  # a model folder: served by the draft-model proposer
    saved: SavedDraft | None = None  # a drafttrain draft, opened once


def _compared_side(spec: CompareSpec, settings: EvalConfig, target: str) -> Side:
    """What a --compare names, checked now (its tree parsed as the run's is): a draft-free proposer, a drafttrain
    draft, or a plain model folder."""
    known = set(PROPOSERS)
    spec.check_shape()
    if spec.tree is not None:
        tree_of(Compared(spec.source, tree=spec.tree).settings(settings.decode_settings()))
    if spec.source in known:
        if "draft" in _proposer_options(spec.source):
            raise DrafttrainError(f"--compare {spec.source}: give the draft's checkpoint or run folder instead of the "
                                  "proposer name (its kind names its proposer)")
        return Side(spec, spec.label or spec.source + spec.suffix, "proposer")
    if not Path(spec.source).expanduser().exists():
        raise DrafttrainError(f"--compare {spec}: {spec.source!r} is neither a draft-free proposer "
                              f"({', '.join(sorted(p for p in known if 'draft' not in _proposer_options(p)))}) nor a "
                              "draft folder")
    label = spec.label or Path(spec.source).name + spec.suffix
    _refuse_foreign(spec.source, target, "--compare")
    config = Path(spec.source).expanduser() / CONFIG_NAME
    if config.is_file() and "drafttrain" not in read_json(config):  # a plain model (another trainer's, say)
        return Side(spec, label, "model_folder")
    # a drafttrain checkpoint, opened now: damage is named before the target loads
    return Side(spec, label, "draft", SavedDraft.open(spec.source))


def _load_compared(side: Side, target: Target, own: dict[str, dict[str, Any]], run: EvalConfig) -> Compared:
    """A --compare side as the evaluator takes it; a draft-free proposer with settings of its own gets them, and a
    depth it cannot fill, the run's default, is fitted to it (as the method's is)."""
    shape = dict(depth=side.spec.depth, tree=side.spec.tree, label=side.label)
    if side.serves == "model_folder":
        return Compared(model_folder_proposer(), **shape, proposer_kwargs={"draft": side.spec.source})
    if side.serves == "proposer" and side.spec.source in own:
        settings = own[side.spec.source]
        if side.spec.depth is None and side.spec.tree is None:
            shape["depth"] = run.fitted_to(PROPOSERS[side.spec.source].deepest(**settings)).depth
        return Compared(side.spec.source, **shape, proposer_kwargs=settings)
    proposer = load_drafter(side.saved, target) if side.serves == "draft" else side.spec.source
    return Compared(proposer, **shape)


def _default_proposer(draft: str | None, saved: SavedDraft | None) -> str:
    """The proposer that serves the --draft checkpoint's kind; a --draft that is no drafttrain checkpoint (a plain
    model, a built-in name) is served as a draft model."""
    if not draft:
        raise DrafttrainError("give --proposer (e.g. prompt_lookup), or --draft with a checkpoint written by drafttrain")
    return model_folder_proposer() if saved is None else saved.kind.proposer


def _settings_sections() -> dict[str, Any]:
    """The registered proposers that have settings of their own, and each one's section (its flags' schema)."""
    return {name: cls.settings_class for name, cls in PROPOSERS.items() if getattr(cls, "settings_class", None)}


def _proposer_settings(args: argparse.Namespace, used: set[str]) -> dict[str, dict[str, Any]]:
    """Each used proposer's own settings, from its flags (the defaults for those not given), validated now, before
    the target loads; a flag of a proposer the run does not use is refused: it could not act."""
    own = {}
    for name, section in _settings_sections().items():
        values = given_values(args, section.model_fields)
        if values and name not in used:
            raise DrafttrainError(f"{', '.join(map(flag_of, values))}: settings of the {name} proposer, which this run "
                                  f"does not use (give --proposer {name} or --compare {name})")
        try:
            own[name] = section.model_validate(values).model_dump()
        except ValidationError as err:
            raise DrafttrainError(describe_errors(err, lambda loc: flag_of(loc[0]) if loc else "")) from None
    return {name: values for name, values in own.items() if name in used}


def _proposer_options(name: str) -> set[str]:
    return set(inspect.signature(PROPOSERS[name]).parameters)


def _looks_like_path(spec: str) -> bool:
    """A local path, not a built-in name or a Hub id (OWNER/NAME whose OWNER is not a folder here: runs/missing is
    a path)."""
    if spec in BUILTIN_TARGETS:
        return False
    is_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not Path(spec).suffix
    return not is_hub_id or Path(spec).parent.is_dir()


def _proposer_kwargs(args: argparse.Namespace, proposer: str) -> dict[str, Any]:
    if not args.draft:
        return {}
    if proposer == model_folder_proposer():  # a plain model folder, built-in name or Hub id
        # The draft runs on the target's device and dtype; build_proposer checks that the tokenizers agree.
        return {"draft": load_target(args.draft, role="draft model (--draft)", dtype=args.dtype, device=args.device)}
    return {"draft": args.draft}


def _greedy_verdict(greedy_match: float | None, temperature: float, strict: bool) -> int:
    if temperature > 0 or greedy_match is None or greedy_match >= 1.0:
        return 0
    banner = "!" * 78
    print(
        f"\n{banner}\nWARNING: at T=0 only {greedy_match:.1%} of prompts produced exactly the baseline's tokens.\n"
        "A lossless engine must reproduce plain greedy decoding; see first_mismatch in report.json, and\n"
        "mismatch_rounding for whether the target's own rounding explains each one (bf16: near-ties).\n"
        f"{banner}\n",
        file=sys.stderr,
    )
    return 1 if strict else 0
