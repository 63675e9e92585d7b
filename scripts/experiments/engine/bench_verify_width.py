"""What a verification forward of w tokens costs on this machine, against one plain decoding step.

    python scripts/experiments/engine/bench_verify_width.py [--target smollm2-135m-instruct] [--max-width 16] [--threads 2]

Both CPU linear kernels are timed in the same process on the same prompt, alternating (PyTorch's own, then oneDNN
with pre-packed weights, drafttrain.cpu_linear, what the evaluator uses by default), twice each.

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

    from drafttrain.cpu_linear import PackedLinears
    from drafttrain.decoding.autodepth import measure_costs
    from drafttrain.decoding.proposers import build_proposer
    from drafttrain.targets import load_target

    target = load_target(args.target)
    prompt = torch.randint(0, target.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    proposer = build_proposer("prompt_lookup", target)
    runs: dict[str, list] = {"default": [], "packed": []}
    for _ in range(2):  # alternate, so that both kernels see the same machine state
        for mode in runs:
            with PackedLinears(target.model, mode=mode):
                runs[mode].append(measure_costs(target, proposer, prompt, args.max_width - 1, args.repeats))
    # width 1 is the plain decoding step
    best = {mode: {w: min(c.verify_s[w] for c in costs) for w in range(1, args.max_width + 1)}
            for mode, costs in runs.items()}
    print(f"{args.target}, {args.threads} threads; {torch.backends.cpu.get_cpu_capability()}; "
          f"the better of two medians of {args.repeats}")
    print("| tokens verified | PyTorch's kernel, ms | × its plain step | packed (oneDNN), ms | × its plain step |")
    print("|---|---|---|---|---|")
    for width in range(1, args.max_width + 1):
        d, p = best["default"], best["packed"]
        print(f"| {width} | {1e3 * d[width]:.1f} | {d[width] / d[1]:.2f} | {1e3 * p[width]:.1f} | "
              f"{p[width] / p[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
