"""``drafttrain export RUN_OR_CHECKPOINT --format FORMAT --out DIR`` (the formats: every kind's codecs)."""

from __future__ import annotations

import argparse

from drafttrain.drafts.registry import formats_by_kind, known_formats
from drafttrain.export.writer import export_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a run's output_dir (its best checkpoint), its checkpoints/ or one checkpoint")
    parser.add_argument("--format", required=True, choices=known_formats(), dest="fmt",
                        help=formats_by_kind())
    parser.add_argument("--out", required=True, help="the folder to write (refused if it holds files)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument("--report", help="a report.json from `drafttrain eval` of this checkpoint for the model "
                                         "card (default: the checkpoint's own evaluation)")
    parser.add_argument("--target", help="the target to load (default: the one the draft was trained for)")
    parser.add_argument("--verifier", help="speculators: the target's Hub id or path as the config names it "
                                           "(default: its Hub id where known, else its local folder)")
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.source, args.fmt, args.out, args.target, device=args.device,
                            overwrite=args.overwrite, report=args.report, verifier=args.verifier)
    print(f"exported {args.source} as {args.fmt} to {out}")
    return 0
