"""The commands: the top layer, which composes the library layers into ``drafttrain <command>``.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; they are imported lazily so that
``drafttrain --help`` stays fast and a stage's heavy imports load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from drafttrain import DrafttrainError, __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("drafttrain.commands.prepare", "load, regenerate, tokenise conversations and build the draft vocab"),
    "plan": ("drafttrain.commands.plan", "print the memory, disk and time a recipe needs, from config files alone"),
    "train": ("drafttrain.commands.train", "train a draft from a recipe (also under accelerate launch)"),
    "eval": ("drafttrain.commands.eval", "measure speculative decoding: tau, acceptance, speedup"),
    "export": ("drafttrain.commands.export", "write a trained draft for vLLM, SGLang or speculators, with a model card"),
    "import": ("drafttrain.commands.import_draft", "read a draft another trainer wrote (speculators' format) as a "
                                                   "drafttrain checkpoint"),
    "capture-server": ("drafttrain.commands.capture_server", "serve the target in vLLM as a capture server for a "
                                                             "recipe (its hidden states for training)"),
    "watch": ("drafttrain.commands.watch", "measure a run's checkpoints in the serving engine as they are saved, "
                                           "from other GPUs or another node"),
    "bench": ("drafttrain.commands.bench", "serve the target in vLLM plainly and with drafts, and sweep concurrency"),
    "push": ("drafttrain.commands.push", "upload an export to the Hugging Face Hub"),
    "report": ("drafttrain.commands.report", "draw a run's training and checkpoint curves as PNG files"),
    "quickstart": ("drafttrain.commands.quickstart", "prepare, train and evaluate the bundled SmolLM2 quick recipe"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drafttrain", description="Train speculative-decoding drafters and measure them.")
    parser.add_argument("--version", action="version", version=f"drafttrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module)
        # Only the chosen subcommand's module is imported: peek at argv to avoid importing every stage.
        if _chosen_command(argv) == name:  # the top-level help lists commands without importing them
            importlib.import_module(module).add_arguments(cmd)
    return parser


def _chosen_command(argv: list[str] | None) -> str | None:
    for arg in sys.argv[1:] if argv is None else argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def parse_with_overrides_anywhere(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``key.sub=value`` overrides are taken wherever they stand, before or after flags (argparse alone stops
    collecting a positional list at the first flag)."""
    args, extra = parser.parse_known_args(argv)
    late = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in late]
    if late and hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + late
    elif late:
        unknown += late
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parse_with_overrides_anywhere(parser, argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except DrafttrainError as err:
        print(f"drafttrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"drafttrain {args.command}: interrupted", file=sys.stderr)
        return 130
