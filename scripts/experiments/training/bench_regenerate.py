"""Throughput of `drafttrain prepare`'s answer regeneration (HF batched greedy generate) against batch size, on the
bundled SmolLM2 target and the bundled Alpaca prompts; with ``--server``, also the recipe's ``openai`` backend
(drafttrain's OpenAIChatClient, ``batch`` requests in flight, as prepare sends them) against a running vLLM or
SGLang server on the same prompts.

    python scripts/experiments/training/bench_regenerate.py [--prompts 64] [--max-new-tokens 96] [--batch-sizes 16 32 64] [--threads N]
        [--server http://127.0.0.1:8000/v1 --served-model NAME]

Each batch size answers the same prompts (sorted by length, as `prepare` batches them); tokens counted up to and
including the stop token (the server's ``usage.completion_tokens``). Prints a markdown table, and how many of
the server's greedy answers equal the built-in generator's.
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
from drafttrain.data.regenerate import HFGenerator, OpenAIChatClient, RegenerationSettings
from drafttrain.targets import load_target

REPO = Path(__file__).resolve().parents[3]


def alpaca_messages(tokenizer, n: int) -> list[list[dict]]:
    """The first n Alpaca prompts as chat messages, sorted by their token length (as prepare batches them)."""
    rows = json.loads((REPO / "data/train/alpaca_en_demo.json").read_text())[:n]
    messages = [[{"role": "user", "content": r["instruction"] + ("\n" + r["input"] if r.get("input") else "")}]
                for r in rows]
    return sorted(messages, key=lambda m: len(prompt_ids(tokenizer, m)))


def served(client: OpenAIChatClient, messages: list[list[dict]], batch: int) -> tuple[list, float]:
    """All prompts through the server, ``batch`` requests in flight; (generations, seconds)."""
    import concurrent.futures

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=batch) as pool:
        generations = list(pool.map(lambda m: client.complete(m, None, 0), messages))
    return generations, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--server", help="an OpenAI-compatible server's base URL (vLLM, SGLang) serving the target")
    parser.add_argument("--served-model", help="the model name the server serves")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target("smollm2-135m-instruct")
    cfg = RegenerateConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    generator = HFGenerator(target.model, target.tokenizer,
                            RegenerationSettings.from_config(cfg, target.name, 0, target.tokenizer))
    messages = alpaca_messages(target.tokenizer, args.prompts)
    prompts = [prompt_ids(target.tokenizer, m) for m in messages]
    generator.generate(prompts[:2], [0, 0])  # warm-up

    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
          f"; {len(prompts)} Alpaca prompts, <= {args.max_new_tokens} new tokens, greedy\n")
    client = OpenAIChatClient(args.server, args.served_model, generator.settings) if args.server else None
    if client:
        served(client, messages[:2], 2)  # warm-up
    print("| generator | batch | tokens | seconds | tokens/s |\n|---|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        start, ours = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            ours += generator.generate(chunk, [0] * len(chunk))
        seconds, tokens = time.perf_counter() - start, sum(g.num_tokens for g in ours)
        print(f"| built-in (HF) | {batch} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |", flush=True)
        if client:
            theirs, seconds = served(client, messages, batch)
            tokens = sum(g.num_tokens for g in theirs)
            same = sum(a.text.strip() == b.text.strip() for a, b in zip(ours, theirs))
            print(f"| server ({args.server}) | {batch} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | "
                  f"{same}/{len(ours)} answers equal the built-in's |", flush=True)


if __name__ == "__main__":
    main()
