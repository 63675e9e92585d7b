"""Held-out top-1 per draft position of several drafts, on one run's validation rows, measured the same way for each
(drafttrain's checkpoint evaluation: the share of trainable tokens where the draft's top-1 is the target's).

    python scripts/experiments/parity/heldout.py RUN_DIR --draft NAME=PATH [--draft NAME=PATH ...] [--out FILE.json]

PATH is anything ``load_drafter`` reads: a drafttrain run or checkpoint, or a reference trainer's draft after
``drafttrain import``. Random anchors (DFlash) and rollouts (P-EAGLE) are drawn from the same seed for every draft.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drafttrain.drafts import load_drafter
from drafttrain.evaluation.checkpoint_eval import held_out
from drafttrain.runfolder import open_dataset
from drafttrain.targets.loading import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--draft", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    target = load_target(args.target)
    rows = open_dataset(args.run / "data" / "validation")
    results = {}
    for name, path in (spec.split("=", 1) for spec in args.draft):
        drafter = load_drafter(path, target).eval()
        torch.manual_seed(0)
        accuracies, measures = held_out(drafter, target, rows)
        results[name] = {"path": path, "top1_per_position": accuracies, **measures}
        print(f"{name:>24}: " + " ".join(f"{a:.3f}" for a in accuracies), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": len(rows), "drafts": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
