"""Throughput of `drafttrain prepare`'s answer regeneration (HF batched greedy generate) against batch size, on the
bundled SmolLM2 target and the bundled Alpaca prompts.

    python scripts/bench_regenerate.py [--prompts 64] [--max-new-tokens 96] [--batch-sizes 16 32 64] [--threads N]

Each batch size answers the same prompts (sorted by length, as `prepare` batches them); tokens counted up to and
including the stop token. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from drafttrain.config import RegenerateConfig
from drafttrain.data.chat import prompt_ids
from drafttrain.data.regenerate import HFGenerator, RegenerationSettings
from drafttrain.targets import load_target

REPO = Path(__file__).resolve().parents[1]


def alpaca_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = json.loads((REPO / "data/train/alpaca_en_demo.json").read_text())[:n]
    conversations = [{"messages": [{"role": "user", "content": r["instruction"] + ("\n" + r["input"] if r.get("input")
                                                                                     else "")}]} for r in rows]
    return sorted((prompt_ids(tokenizer, c["messages"]) for c in conversations), key=len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target("smollm2-135m-instruct")
    cfg = RegenerateConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    generator = HFGenerator(target.model, target.tokenizer,
                            RegenerationSettings.from_config(cfg, target.name, 0, target.tokenizer))
    prompts = alpaca_prompts(target.tokenizer, args.prompts)
    generator.generate(prompts[:2], [0, 0])  # warm-up

    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
          f"; {len(prompts)} Alpaca prompts, <= {args.max_new_tokens} new tokens, greedy\n")
    print("| batch | tokens | seconds | tokens/s |\n|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            tokens += sum(g.num_tokens for g in generator.generate(chunk, [0] * len(chunk)))
        seconds = time.perf_counter() - start
        print(f"| {batch} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
