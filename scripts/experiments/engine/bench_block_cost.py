"""What drafting k tokens costs per cycle, for the sequential and the parallel drafters, against one plain step.

    python scripts/experiments/engine/bench_block_cost.py [--lengths 4 8 16] [--draft-vocab RUN/draft_vocab.safetensors] [--threads 2]
        [--repeats 9] [--out FILE.json]

For each draft length k: an EAGLE-3 head drafting a chain of k (k sequential forwards of the head), a P-EAGLE head
(parallel.depths k: one forward of k - 1 mask slots), a DFlash drafter with block size k + 1 (one forward of the
block; 2 layers, as recipes/smollm2_dflash.yaml) and a PARD draft model (every 5th target layer, parallel k: one forward
of k - 1 mask tokens), each built fresh for SmolLM2 (the cost does not depend on training). Every proposal and the
plain step are timed as ``--depth auto`` times them (drafttrain.decoding.autodepth.measure_costs: after the target's
prefill of a 120-token prompt, interleaved rounds, medians), with the evaluator's packed CPU kernels.

On a GPU (``--device cuda --dtype bfloat16``) each timing waits for the kernels it queued, and ``--profile`` adds
what one call of each costs in PyTorch's profiler: the kernels launched, the host-device copies and syncs, and the
GPU's busy time against the wall time (a call far longer than its kernels is bound by launching them, not by them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from drafttrain.config import DFlashConfig, DraftModelConfig, Eagle3Config
from drafttrain.cpu_linear import PackedLinears
from drafttrain.decoding.autodepth import measure_costs, prefilled, verify_once
from drafttrain.decoding.proposers import DraftRequest, build_proposer
from drafttrain.decoding.trees import Chain
from drafttrain.drafts import build_drafter
from drafttrain.sampling import Sampling
from drafttrain.targets import load_target, synchronize


def drafters(length: int, vocab: str | None):
    """(name, draft config) of each drafter at draft length ``length``, on draft vocabulary ``vocab`` (a file)."""
    head = dict(init_from_target=["lm_head", "layer", "fc"], draft_vocab=vocab)
    return [("eagle3 (chain)", Eagle3Config(ttt_steps=1, **head)),
            ("p-eagle", Eagle3Config(parallel={"depths": length}, **head)),
            ("dflash", DFlashConfig(block_size=length + 1, num_layers=2, draft_vocab=vocab)),
            ("pard", DraftModelConfig(cut="every:5", parallel=length, draft_vocab=vocab,
                                      loss_vocab="draft" if vocab else "full"))]


def profiled(fn, device: torch.device, calls: int) -> dict:
    """Per call of ``fn``: wall ms, GPU kernel ms, kernels launched, host-device copies and syncs (profiler counts)."""
    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        wall_s = time.perf_counter() - start  # the profiler's own overhead included
    events = prof.key_averages()

    def count(*names: str) -> float:
        return sum(e.count for e in events if any(n in e.key for n in names)) / calls

    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"aten_ops": count("aten::"), "kernels": count("cudaLaunchKernel", "cuLaunchKernel"),
            "copies": count("cudaMemcpyAsync"), "syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize"),
            "gpu_busy_ms": round(kernel_us / calls / 1e3, 3), "wall_ms_profiled": round(wall_s / calls * 1e3, 3)}


def profile_row(target, proposer, prompt: torch.Tensor, length: int, calls: int) -> dict:
    """The profiler's counts for one proposal of ``length`` tokens and one verification of ``length + 1``."""
    cache, prefix, next_token, _ = prefilled(target, proposer, prompt.to(target.device))
    request = DraftRequest(Chain(length), Sampling(), torch.Generator(device=target.device).manual_seed(0))
    return {"draft": profiled(lambda: proposer.propose(request), target.device, calls),
            "verify": profiled(lambda: verify_once(target.model, cache, prefix, next_token, width=length + 1),
                               target.device, calls)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--profile", action="store_true", help="also profile one call of each (above)")
    parser.add_argument("--draft-vocab", help="a draft_vocab.safetensors (as the recipes' runs have): the drafters "
                                              "compute those lm_head rows alone, as trained ones do")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    prompt = torch.randint(0, target.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    rows = []
    for length in args.lengths:
        for name, config in drafters(length, args.draft_vocab):
            rows.append(measure_row(target, name, config, prompt, length, args))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.target} on {target.device} ({args.dtype}), {args.threads} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; medians of {args.repeats}, interleaved")
    print("| drafter | k tokens | draft ms per cycle | × a plain step | verification of k+1, × a plain step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['k']} | {r['draft_ms']:.1f} | {r['draft_over_plain']:.2f} | "
              f"{r['verify_over_plain']:.2f} |")
    if args.profile:
        print("\n| drafter | k | call | wall ms (profiled) | GPU busy ms | aten ops | kernels | copies | syncs |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for call, p in r["profile"].items():
                print(f"| {r['drafter']} | {r['k']} | {call} | {p['wall_ms_profiled']:.2f} | {p['gpu_busy_ms']:.2f} | "
                      f"{p['aten_ops']:.0f} | {p['kernels']:.0f} | {p['copies']:.0f} | {p['syncs']:.0f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


def measure_row(target, name: str, config, prompt: torch.Tensor, length: int, args) -> dict:
    """One drafter's cost table at draft length ``length`` (and its profile on a GPU with ``--profile``)."""
    drafter = build_drafter(config, target).to(device=target.device, dtype=target.model.dtype).eval()
    proposer = build_proposer(drafter.proposer, target, draft=drafter)
    with PackedLinears(target.model) if target.device.type == "cpu" else contextlib.nullcontext() as kernels:
        if kernels is not None:
            kernels.add(*proposer.modules())
        costs = measure_costs(target, proposer, prompt, length, args.repeats)
    row = {"drafter": name, "k": length, "draft_ms": round(1e3 * costs.draft_s[length], 2),
           "plain_ms": round(1e3 * costs.plain_s, 2),
           "draft_over_plain": round(costs.draft_s[length] / costs.plain_s, 3),
           "verify_over_plain": round(costs.verify_s[length + 1] / costs.plain_s, 3)}
    if args.profile:
        row["profile"] = profile_row(target, proposer, prompt, length, args.repeats)
    return row


if __name__ == "__main__":
    sys.exit(main())
