"""``drafttrain import FOLDER --target T --out DIR``: a draft another trainer wrote (in a format one of the kinds'
readers reads, drafttrain.drafts.codecs), as a drafttrain checkpoint that ``eval`` and ``export`` take like our own
and ``train`` continues (``draft.init_from``)."""

from __future__ import annotations

import argparse

from drafttrain.export.importer import import_draft
from drafttrain.targets import load_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="the draft's folder (config.json and model.safetensors), as its trainer wrote it")
    parser.add_argument("--target", required=True, help="the target it serves: checked against the draft's sizes "
                                                        "and layers")
    parser.add_argument("--out", required=True, help="the checkpoint folder to write (refused if it holds files)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    out, notes = import_draft(args.source, load_target(args.target, device=args.device), args.out,
                              overwrite=args.overwrite)
    print(f"imported {args.source} to {out}")
    for note in notes:
        print(f"note: {note}")
    return 0
