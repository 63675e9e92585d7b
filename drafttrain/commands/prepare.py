"""``drafttrain prepare``: recipe -> mixture -> (regenerated answers) -> tokenised datasets -> draft vocab ->
(offline target outputs) -> summary. The pipeline and what it writes: :mod:`drafttrain.training.prepare`.
"""

from __future__ import annotations

import argparse

from drafttrain.config import load_recipe
from drafttrain.training.plan import check_fits
from drafttrain.training.prepare import prepare, prepare_launched
from drafttrain.training.runtime import end_processes, process_state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="recipe overrides, e.g. data.num_samples=16"
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="take at most N conversations (quick runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)  # the whole recipe is validated before any work
    check_fits(recipe, "prepare")  # an offline cache that clearly cannot fit on disk is refused before any work
    state = process_state()
    if state.num_processes > 1:
        try:
            summary = prepare_launched(recipe, state, args.limit, not args.no_progress)
        finally:
            end_processes()
    else:
        summary = prepare(recipe, limit=args.limit, progress=not args.no_progress)
    if summary is not None:
        print(f"prepared {summary.train_rows} train / {summary.validation_rows} validation rows -> {summary.run.root}")
    return 0
