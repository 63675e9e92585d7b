"""``drafttrain eval``: speculative decoding vs plain decoding on a question suite; writes report.json/.md/.png.

Cheap inputs (suite, numbers, draft path, proposer name) are checked before the target loads, so a typo fails in
a second, not after a model load. Exit codes: 0 ok, 2 bad input (message names the cause), 1 ``--strict`` and the
greedy output differs from the baseline at T=0.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import ValidationError

from drafttrain import DrafttrainError
from drafttrain.config import EvalConfig, describe_errors
from drafttrain.cpu_linear import cpu_linear_mode
from drafttrain.decoding import PROPOSERS
from drafttrain.decoding.proposers import model_folder_proposer, trained_draft
from drafttrain.decoding.trees import tree_of
from drafttrain.drafts import load_drafter, saved_kind
from drafttrain.drafts.registry import saved_max_depth
from drafttrain.evaluation.checkpoint_eval import CALIBRATION_PROMPTS
from drafttrain.evaluation.evaluate import evaluate
from drafttrain.evaluation.report import print_report, write_report
from drafttrain.evaluation.sides import Compared
from drafttrain.evaluation.suites import Suite, load_suite, served_kind, without_reported
from drafttrain.runfolder import CONFIG_NAME, RunFolder, drafttrain_checkpoint, read_json
from drafttrain.targets import BUILTIN_TARGETS, load_target

log = logging.getLogger(__name__)

FEEDBACK_FILE = "feedback.jsonl"
_DEFAULTS = EvalConfig()  # one source of truth for defaults shared with recipes' eval section
DTYPES = ("float32", "bfloat16", "float16", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: built-in name, folder, .gguf or Hub id")
    parser.add_argument("--proposer", help=f"proposer name: {', '.join(PROPOSERS)} (default: the one "
                                           "that serves the --draft checkpoint's kind)")
    parser.add_argument("--draft", help="a drafttrain checkpoint or run folder, or a draft model (built-in name, "
                                        f"folder, .gguf) for the {model_folder_proposer()} proposer")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--suite", default=_DEFAULTS.suite, help="built-in suite: mt_bench, humaneval, gsm8k, alpaca")
    prompts.add_argument("--questions", help="FastChat-format .jsonl (question_id, category, turns) instead of a suite")
    parser.add_argument("--out", required=True, help="output folder for report.json, report.md, acceptance.png")
    parser.add_argument("--num-prompts", type=_num_prompts, default=_DEFAULTS.num_prompts,
                        help="N questions taken one category at a time in turn (each category's in file order, so a "
                             "small N covers every category; report.json lists their question_ids), or 'all' "
                             "(default %(default)s)")
    parser.add_argument("--turns", choices=("1", "all"), default="all", help="ask only the first turn, or all turns")
    parser.add_argument("--max-new-tokens", type=int, default=_DEFAULTS.max_new_tokens, help="per turn")
    parser.add_argument("--temperature", type=float, default=_DEFAULTS.temperature)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--depth", "-k", type=_depth, default=None,
                        help=f"draft length k / tree depth, or 'auto': the chain depth and confidence threshold chosen "
                             "from this machine's measured costs and the draft's acceptance on --calibration prompts "
                             f"(default {_DEFAULTS.depth}, or the draft's deepest when it cannot fill that)")
    parser.add_argument("--max-depth", type=int, default=_DEFAULTS.max_depth, help="the deepest chain --depth auto tries")
    parser.add_argument("--min-confidence", type=float, default=_DEFAULTS.min_confidence,
                        help="stop a chain once the product of the draft's top probabilities falls below this")
    parser.add_argument("--calibration", help="prompts for --depth auto (a suite name or FastChat .jsonl); default: "
                                              "the suite's own prompts that are not reported, else the draft run's "
                                              "held-out validation prompts, else another suite")
    parser.add_argument("--no-runtime-check", action="store_true",
                        help="keep an auto choice all run long (default: it is checked while decoding and falls back "
                             "to a shallower chain or plain decoding when it does not pay on this machine)")
    parser.add_argument("--tree", default=_DEFAULTS.tree,
                        help="chain | dynamic | a named static tree (medusa-16, ...) | a .json file of paths | "
                             "static:PATHS_JSON (inline, Medusa's format: [[0], [1], [0, 0]]) | auto (a static tree "
                             "built from the draft's measured accuracies, sized for this machine)")
    parser.add_argument("--total-tokens", type=int, default=None, help="dynamic tree: nodes verified per step (60)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="dynamic tree only: children expanded per node (10); not sampling's top-k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hf-reference", action="store_true",
                        help="also time HF model.generate (plain, and prompt lookup / assisted to match the proposer)")
    parser.add_argument("--compare", action="append", default=[], metavar="[LABEL=]PROPOSER_OR_DRAFT[@SHAPE]",
                        help="also run another side on the same prompts in the same run, against the same baseline: "
                             "a draft-free proposer (prompt_lookup), a trained draft's checkpoint/run folder, or a plain "
                             "model folder (served as a draft model, as --draft serves one); @SHAPE "
                             "gives it its own chain depth (@3, @auto) or tree (@tree:medusa-16, @tree:auto); LABEL= "
                             "names it in the report (default: the proposer or the folder's name); repeatable")
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


def _num_prompts(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {text!r}") from None
    return value  # sign checked in run(), with the other numbers, so the error goes through DrafttrainError


def _depth(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    settings = eval_settings(args)
    suite = load_suite(settings.suite).select(settings.num_prompts, turns=args.turns)
    tree_of(settings)  # a bad tree spec fails now, before the target loads
    _check_proposer(args, settings)
    if args.draft and drafttrain_checkpoint(args.draft) is not None:
        settings = settings.fitted_to(saved_max_depth(args.draft))
    autos = [settings.depth, settings.tree, *(s for side in args.compared for s in (side.depth, side.tree))]
    calibration = _calibration(args, suite) if "auto" in autos else ()
    _prepare_out_dir(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    if args.draft and drafttrain_checkpoint(args.draft) is not None:
        # a drafttrain draft: loaded (and checked) here, so the report records which weights it measured
        method, method_kwargs = trained_draft(args.proposer, target, load_drafter(args.draft, target)), {}
    else:
        method, method_kwargs = args.proposer, _proposer_kwargs(args)
    if args.draft_vocab is not None:
        method_kwargs["vocab"] = False if args.draft_vocab == "none" else args.draft_vocab
    report = evaluate(target, method, suite, settings.decode_settings(), calibration=calibration,
                      hf_reference=args.hf_reference, progress=not args.no_progress, proposer_kwargs=method_kwargs,
                      compare=[_load_compared(side, target) for side in args.compared], cpu_linear=args.cpu_linear,
                      feedback=Path(args.out) / FEEDBACK_FILE if args.feedback else None)
    paths = write_report(report, args.out)
    print_report(report)
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return _greedy_verdict(report.greedy_match, settings.temperature, args.strict)


# The schema field each flag fills, where the two names differ (the others: --max-new-tokens -> max_new_tokens).
FLAG_OF = {"tree_top_k": "--top-k", "suite": "--suite / --questions"}


def eval_settings(args: argparse.Namespace) -> EvalConfig:
    """The flags as the recipe's typed eval section, validated there; an error names the flag. CLI-only inputs
    (the CPU kernels, threads) are checked here."""
    cpu_linear_mode(args.cpu_linear)  # a bad DRAFTTRAIN_CPU_LINEAR fails here, before the target loads
    if args.threads is not None and args.threads <= 0:
        raise DrafttrainError(f"--threads must be positive, got {args.threads}")
    _dynamic_tree_flags_only_with_it(args)
    values = dict(suite=args.questions or args.suite, num_prompts=args.num_prompts,
                  max_depth=args.max_depth, min_confidence=args.min_confidence, tree=args.tree,
                  temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens,
                  runtime_check=not args.no_runtime_check)
    values.update({field: value for field, value in (("total_tokens", args.total_tokens), ("tree_top_k", args.top_k))
                   if value is not None})
    if args.depth is not None:  # left out otherwise, so the default can fit the draft (EvalConfig.fitted_to)
        values["depth"] = args.depth
    try:
        return EvalConfig.model_validate(values)
    except ValidationError as err:
        flag = lambda loc: FLAG_OF.get(loc[0], "--" + loc[0].replace("_", "-")) if loc else ""  # noqa: E731
        raise DrafttrainError(describe_errors(err, flag)) from None


def _dynamic_tree_flags_only_with_it(args: argparse.Namespace) -> None:
    """--top-k and --total-tokens shape the dynamic tree; on any other shape they cannot act, and a user who means
    sampling's top-k (as in every other LLM tool) would silently sample without it."""
    given = [flag for flag, value in (("--top-k", args.top_k), ("--total-tokens", args.total_tokens))
             if value is not None]
    if given and args.tree != "dynamic":
        raise DrafttrainError(f"{' and '.join(given)} shape the dynamic tree (--tree dynamic) and cannot act on "
                              f"--tree {args.tree}; --top-k is not sampling's top-k, which has no flag: set eval.top_k "
                              "in a recipe")


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


def _check_proposer(args: argparse.Namespace, settings: EvalConfig) -> None:
    """Fail before loading the target: unknown proposer name, or a draft that is needed but missing. Without
    --proposer, the --draft checkpoint's kind names the proposer that serves it."""
    known = set(PROPOSERS)
    if args.draft and _looks_like_path(args.draft) and not Path(args.draft).expanduser().exists():
        raise DrafttrainError(f"draft not found: {args.draft}")
    if args.proposer is None:
        args.proposer = _default_proposer(args.draft)
    if args.proposer not in known:
        raise DrafttrainError(f"unknown proposer {args.proposer!r}: choose one of {', '.join(sorted(known))}")
    if args.draft and "draft" not in _proposer_options(args.proposer):
        raise DrafttrainError(f"--draft is not used by proposer {args.proposer!r} (it needs no draft model)")
    if args.proposer == model_folder_proposer() and not args.draft:
        raise DrafttrainError(f"proposer {args.proposer} needs --draft (a draft model: built-in name, folder or .gguf)")
    if args.draft_vocab is not None:
        if args.proposer != model_folder_proposer():
            raise DrafttrainError(f"--draft-vocab is for the {model_folder_proposer()} proposer, not {args.proposer!r}")
        if args.draft_vocab != "none" and not Path(args.draft_vocab).is_file():
            raise DrafttrainError(f"--draft-vocab: no such file {args.draft_vocab}")
    args.compared = [_compared_side(item, known, settings) for item in args.compare]


class Side(NamedTuple):
    spec: str  # a draft-free proposer's name or a draft folder
    is_draft: bool
    depth: int | str | None
    tree: Any
    label: str  # the name in the report: the proposer or the draft folder's, with the shape given
    model_folder: bool = False  # a plain HF model folder, served by the draft-model proposer as --draft serves one


def _compared_side(item: str, known: set[str], settings: EvalConfig) -> Side:
    """``[LABEL=]PROPOSER_OR_DRAFT[@SHAPE]`` -> the side, checked now (its tree parsed as the run's is)."""
    label, named, rest = item.partition("=")
    if named and label and "/" not in label and not Path(item.partition("@")[0]).expanduser().exists():
        side = _compared_side(rest, known, settings)
        return side._replace(label=label)
    spec, _, shape = item.partition("@")
    depth = tree = None
    if shape.startswith("tree:"):
        tree = shape.removeprefix("tree:")
        tree_of(Compared(spec, tree=tree).settings(settings.decode_settings()))
    elif shape:
        depth = _depth(shape) if shape == "auto" or shape.isdigit() else None
        if depth is None or depth == 0:
            raise DrafttrainError(f"--compare {item}: @{shape} is neither a depth (@3, @auto) nor a tree (@tree:...)")
    if spec in known:
        if "draft" in _proposer_options(spec):
            raise DrafttrainError(f"--compare {spec}: give the draft's checkpoint or run folder instead of the "
                                  "proposer name (its kind names its proposer)")
        return Side(spec, False, depth, tree, item)
    if not Path(spec).expanduser().exists():
        raise DrafttrainError(f"--compare {item}: {spec!r} is neither a draft-free proposer "
                              f"({', '.join(sorted(p for p in known if 'draft' not in _proposer_options(p)))}) nor a "
                              "draft folder")
    label = Path(spec).name + (f"@{shape}" if shape else "")
    config = Path(spec).expanduser() / CONFIG_NAME
    if config.is_file() and "drafttrain" not in read_json(config):  # a plain model (another trainer's, say)
        return Side(spec, False, depth, tree, label, model_folder=True)
    saved_kind(spec)  # a drafttrain checkpoint (damage named now, not after the target loads)
    return Side(spec, True, depth, tree, label)


def _load_compared(side: Side, target) -> Compared:
    if side.model_folder:
        return Compared(model_folder_proposer(), depth=side.depth, tree=side.tree, label=side.label,
                        proposer_kwargs={"draft": side.spec})
    proposer = load_drafter(side.spec, target) if side.is_draft else side.spec
    return Compared(proposer, depth=side.depth, tree=side.tree, label=side.label)


def _default_proposer(draft: str | None) -> str:
    """The proposer that serves the --draft checkpoint's kind; a folder that is no drafttrain checkpoint (a plain
    model, a built-in name) is served as a draft model. A damaged checkpoint fails here, naming its file."""
    if not draft:
        raise DrafttrainError("give --proposer (e.g. prompt_lookup), or --draft with a checkpoint written by drafttrain")
    directory = drafttrain_checkpoint(draft)
    return model_folder_proposer() if directory is None else saved_kind(directory).proposer


def _proposer_options(name: str) -> set[str]:

    return set(inspect.signature(PROPOSERS[name]).parameters)


def _looks_like_path(spec: str) -> bool:
    """A local path, not a built-in name or a Hub id (OWNER/NAME whose OWNER is not a folder here: runs/missing is
    a path)."""
    if spec in BUILTIN_TARGETS:
        return False
    is_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not Path(spec).suffix
    return not is_hub_id or Path(spec).parent.is_dir()


def _proposer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if not args.draft:
        return {}
    if args.proposer == model_folder_proposer():  # a plain model folder, built-in name or Hub id
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
