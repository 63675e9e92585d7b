"""What a verification forward of w tokens costs on this machine, against one plain decoding step.

    python scripts/bench_verify_width.py [--target smollm2-135m-instruct] [--max-width 16] [--threads 2]

The cost that decides speculative decoding on a CPU: one target forward of w tokens (w = depth + 1 for a chain,
the node count for a tree) with the KV cache of a 120-token prompt, timed exactly as ``--depth auto`` times it
(drafttrain.decoding.autodepth.measure_costs, the median of repeated calls). On a GPU the ratio stays near 1 up to
a few dozen tokens; on a CPU it depends on the BLAS's small-matrix kernels, and so on the processor.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--max-width", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from drafttrain.decoding.autodepth import measure_costs
    from drafttrain.decoding.proposers import build_proposer
    from drafttrain.targets import load_target

    target = load_target(args.target)
    prompt = torch.randint(0, target.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    costs = measure_costs(target, build_proposer("prompt_lookup", target), prompt, args.max_width - 1, args.repeats)
    print(f"{args.target}, {args.threads} threads; {torch.backends.cpu.get_cpu_capability()}")
    print("| tokens verified | ms | × one plain step |\n|---|---|---|")
    for width in range(1, args.max_width + 1):
        print(f"| {width} | {1e3 * costs.verify_s[width]:.1f} | {costs.verify_s[width] / costs.plain_s:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
