#!/usr/bin/env python
"""Per-step overhead of our speculative loop against the raw target forward of the same shape.

    python scripts/experiments/engine/bench_overhead.py --threads 1 --steps 32 --repeats 3

For each draft shape (plain decoding, a chain, a static tree, a 60-node EAGLE-2-sized tree; greedy and sampling)
an oracle proposer returns the same shape every step at no cost, with the target's greedy continuation on the
*last* root-to-leaf path for half the depth, so greedy steps accept tokens and trees need the KV gather.

  * loop step:   (wall - prefill - proposer time) / verification forwards: everything our loop does per step
                 (the forward, mask and positions, warping, verification, KV-cache compaction, bookkeeping);
  * model call:  the time spent inside ``target.model(...)`` during those same steps (forward hooks), so
                 overhead = loop step / model call - 1 compares like with like under the same CPU load;
  * raw forward: a separate replay of the same forwards on the bare HF model (same input length, same
                 prebuilt 4D mask and positions, same cache growth by a plain crop) as a cross-check.

The median over repeats is reported. On a CPU shared with other jobs the absolute milliseconds move a lot
between runs; the in-run overhead much less, the raw-replay comparison more.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="verification steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None, help="comma-separated shape names to run")
    return parser.parse_args(argv)


def eagle2_sized_tree(levels=(8, 16, 16, 10, 6, 4)) -> list[int]:
    """A 60-node, depth-6 topology shaped like EAGLE-2's (wide near the root, children spread over the best
    few parents of the level above)."""
    parents, prev = [], [-1]
    for size in levels:
        start = len(parents)
        parents += [prev[i % min(len(prev), 4)] for i in range(size)]
        prev = list(range(start, start + size))
    return parents


SHAPES = {
    "plain": [],
    "chain-4": [-1, 0, 1, 2],
    "static-10": [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6],  # Medusa-style
    "tree-60": eagle2_sized_tree(),
}


def oracle_proposer(parents: list[int], continuation: list[int], vocab: int):
    from drafttrain.decoding import Draft, Proposer
    from drafttrain.decoding.trees import node_depths

    depths = node_depths(tuple(parents))
    path = []  # the last deepest node's root-to-leaf path
    node = max(range(len(parents)), key=lambda i: (depths[i], i)) if parents else -1
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    correct = path[: max(1, len(path) // 2)] if path else []

    class Oracle(Proposer):
        name = "oracle"
        per_step = len(correct)

        def prefill(self, input_ids, hidden, next_token):
            self.done, self.g = 1, torch.Generator().manual_seed(0)

        def propose(self, request):
            tokens = torch.randint(0, vocab, (1, len(parents)), generator=self.g)
            for depth, node in enumerate(correct):
                if self.done + depth < len(continuation):
                    tokens[0, node] = continuation[self.done + depth]
            return Draft(tokens, parents)

        def accept(self, tokens, hidden):
            self.done += tokens.shape[1]

    return Oracle()


class ModelTimer:
    """Forward hooks that time every call of ``model`` (its whole forward, HF's own mask building included)."""

    def __init__(self, model):
        self.durations: list[float] = []
        self.handles = [
            model.register_forward_pre_hook(lambda *_: setattr(self, "t0", time.perf_counter())),
            model.register_forward_hook(lambda *_: self.durations.append(time.perf_counter() - self.t0)),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_engine(target, parents, prompt, steps, continuation, temperature) -> tuple[float, float, list[int]]:
    """-> (loop seconds per step, model-call seconds per step, accepted per step)."""
    from drafttrain.decoding import SpeculativeDecoder

    proposer = oracle_proposer(parents, continuation, target.vocab_size)
    decoder = SpeculativeDecoder(target, proposer, depth=1, temperature=temperature, seed=0)
    timer = ModelTimer(target.model)
    try:
        out = decoder.generate(prompt, max_new_tokens=steps * (proposer.per_step + 1) + 1)
    finally:
        timer.remove()
    s = out.stats
    loop = (s.wall_time_s - s.prefill_time_s - s.proposer_time_s) / s.target_forwards
    model = sum(timer.durations[1:]) / s.target_forwards  # [0] is the prefill
    return loop, model, s.accepted_per_step


def run_raw(target, parents, prompt, accepted: list[int]) -> float:
    from transformers import DynamicCache

    from drafttrain.decoding.trees import additive_mask, ancestor_matrix, cache_argument, tree_position_ids

    model, n = target.model, len(parents) + 1
    tree = parents != list(range(-1, len(parents) - 1))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        with_cache = {cache_argument(type(model)): cache, "use_cache": True}
        model(input_ids=torch.tensor([prompt]), **with_cache, logits_to_keep=1)
        total = 0.0
        for acc in accepted:
            prefix = cache.get_seq_length()
            ids = torch.randint(0, target.vocab_size, (1, n))
            kwargs = {}
            if tree:
                kwargs["position_ids"] = tree_position_ids(parents, prefix, ids.device)
                allowed = ancestor_matrix(tuple(parents))
                kwargs["attention_mask"] = additive_mask(allowed, prefix, model.dtype, ids.device)
            start = time.perf_counter()
            model(input_ids=ids, **with_cache, **kwargs)
            total += time.perf_counter() - start
            cache.crop(-(n - 1 - acc))
    return total / len(accepted)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from drafttrain.decoding import plain_decode
    from drafttrain.targets import load_target

    target = load_target(args.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.vocab_size, (args.prompt_len,), generator=g).tolist()
    continuation = plain_decode(target, prompt, 4 * args.steps).tokens
    names = args.only.split(",") if args.only else list(SHAPES)
    rows = []
    for name in names:
        parents = SHAPES[name]
        for temperature in (0.0, 1.0):
            loops, models, raws, ratios = [], [], [], []
            for _ in range(args.repeats):
                loop, model, accepted = run_engine(target, parents, prompt, args.steps, continuation, temperature)
                loops.append(loop)
                models.append(model)
                ratios.append(loop / model - 1)
                raws.append(run_raw(target, parents, prompt, accepted))
            row = dict(
                shape=name, tokens=len(parents) + 1, mode="greedy" if temperature == 0 else "T=1",
                model=statistics.median(models) * 1e3, loop=statistics.median(loops) * 1e3,
                overhead=100 * statistics.median(ratios), raw=statistics.median(raws) * 1e3,
                accepted=sum(accepted) / len(accepted),
            )
            row["vs_raw"] = 100 * (row["loop"] / row["raw"] - 1)
            rows.append(row)
            print(f"  {name:10s} {row['mode']:6s} model {row['model']:7.1f} ms  loop {row['loop']:7.1f} ms  "
                  f"overhead {row['overhead']:+.1f}%  raw replay {row['raw']:7.1f} ms", flush=True)
    print(f"\ntarget {args.target}, torch threads {args.threads}, prompt {args.prompt_len} tokens, "
          f"~{args.steps} steps x {args.repeats} repeats (medians)\n")
    print("| shape | tokens/forward | mode | model call (ms) | loop step (ms) | overhead (in-run) "
          "| raw replay (ms) | loop vs raw replay | accepted/step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['model']:.1f} | {r['loop']:.1f} | "
              f"{r['overhead']:+.1f}% | {r['raw']:.1f} | {r['vs_raw']:+.1f}% | {r['accepted']:.2f} |")


if __name__ == "__main__":
    main()
