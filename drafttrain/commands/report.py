"""``drafttrain report RUN``: the run's curves as PNG files in ``RUN/plots`` (no wandb needed)."""

from __future__ import annotations

import argparse

from drafttrain.evaluation.run_plots import write_run_plots
from drafttrain.runfolder import RunFolder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run's output_dir")


def run(args: argparse.Namespace) -> int:
    for path in write_run_plots(RunFolder.of(args.run)):
        print(f"wrote {path}")
    return 0
