"""What drafting k tokens costs per cycle, for the sequential and the parallel drafters, against one plain step.

    python scripts/bench_block_cost.py [--lengths 4 8 16] [--draft-vocab RUN/draft_vocab.safetensors] [--threads 2]
        [--repeats 9] [--out FILE.json]

For each draft length k: an EAGLE-3 head drafting a chain of k (k sequential forwards of the head), a P-EAGLE head
(parallel_depths k: one forward of k - 1 mask slots), a DFlash drafter with block size k + 1 (one forward of the
block; 2 layers, as recipes/smollm2_dflash.yaml) and a PARD draft model (every 5th target layer, parallel k: one forward
of k - 1 mask tokens), each built fresh for SmolLM2 (the cost does not depend on training). Every proposal and the
plain step are timed as ``--depth auto`` times them (drafttrain.decoding.autodepth.measure_costs: after the target's
prefill of a 120-token prompt, interleaved rounds, medians), with the evaluator's packed CPU kernels.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from drafttrain.config import DFlashConfig, DraftModelConfig, Eagle3Config
from drafttrain.cpu_linear import PackedLinears
from drafttrain.decoding.autodepth import measure_costs
from drafttrain.decoding.proposers import build_proposer
from drafttrain.drafts import build_drafter
from drafttrain.targets import load_target


def drafters(length: int, vocab: str | None):
    """(name, draft config) of each drafter at draft length ``length``, on draft vocabulary ``vocab`` (a file)."""
    head = dict(init_from_target=["lm_head", "layer", "fc"], draft_vocab=vocab)
    return [("eagle3 (chain)", Eagle3Config(ttt_steps=1, **head)),
            ("p-eagle", Eagle3Config(parallel_depths=length, **head)),
            ("dflash", DFlashConfig(block_size=length + 1, num_layers=2, draft_vocab=vocab)),
            ("pard", DraftModelConfig(cut="every:5", parallel=length, draft_vocab=vocab,
                                      loss_vocab="draft" if vocab else "full"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--draft-vocab", help="a draft_vocab.safetensors (as the recipes' runs have): the drafters "
                                              "compute those lm_head rows alone, as trained ones do")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prompt = torch.randint(0, target.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    rows = []
    for length in args.lengths:
        for name, config in drafters(length, args.draft_vocab):
            drafter = build_drafter(config, target).eval()
            proposer = build_proposer(drafter.proposer, target, draft=drafter)
            with PackedLinears(target.model) as kernels:
                kernels.add(*proposer.modules())
                costs = measure_costs(target, proposer, prompt, length, args.repeats)
            rows.append({"drafter": name, "k": length, "draft_ms": round(1e3 * costs.draft_s[length], 2),
                         "plain_ms": round(1e3 * costs.plain_s, 2),
                         "draft_over_plain": round(costs.draft_s[length] / costs.plain_s, 3),
                         "verify_over_plain": round(costs.verify_s[length + 1] / costs.plain_s, 3)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.target}, {args.threads} threads, {torch.backends.cpu.get_cpu_capability()}; medians of "
          f"{args.repeats}, interleaved")
    print("| drafter | k tokens | draft ms per cycle | × a plain step | verification of k+1, × a plain step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['k']} | {r['draft_ms']:.1f} | {r['draft_over_plain']:.2f} | "
              f"{r['verify_over_plain']:.2f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
