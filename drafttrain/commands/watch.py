"""``drafttrain watch RECIPE.yaml [key.sub=value ...] [--once] [--poll-s S] [--agreement]``

Measures a run's checkpoints in the serving engine from a process of its own (other GPUs, another node), while the
run trains or after it finished: each once, into the run's metrics.jsonl, its wandb run and its best checkpoint
(drafttrain.runs.watch). The recipe is the one the run trains with (its eval.engine_settings say how the engine
runs; eval.engine_settings.inline false leaves the checkpoints to the watcher).
"""

from __future__ import annotations

import argparse
import signal

from drafttrain import DrafttrainError
from drafttrain.config import load_recipe
from drafttrain.runs.watch import watch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="the run's recipe YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides (YAML values)")
    parser.add_argument("--once", action="store_true", help="one pass over the checkpoints there now, then end")
    parser.add_argument("--poll-s", type=float, default=30.0, metavar="S",
                        help="seconds between looks for new checkpoints (default %(default)s)")
    parser.add_argument("--agreement", action="store_true",
                        help="hold the whole target here and decode each checkpoint's prompts with drafttrain's "
                             "evaluator too, comparing the two τ (also for checkpoints measured without it)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the engine's servers the same way Ctrl-C does


def run(args: argparse.Namespace) -> int:
    if args.poll_s <= 0:
        raise DrafttrainError(f"--poll-s must be above 0, got {args.poll_s}")
    signal.signal(signal.SIGTERM, _interrupt)
    result = watch(load_recipe(args.recipe, args.overrides), once=args.once, poll_s=args.poll_s,
                   agreement=args.agreement)
    print(f"measured {len(result.measured)} checkpoint(s) in the engine"
          + (f", added the agreement to {len(result.agreed)}" if result.agreed else "")
          + (f"; {len(result.pruned)} pruned while measured" if result.pruned else ""))
    return 0
