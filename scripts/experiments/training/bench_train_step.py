"""Training throughput of an EAGLE head on the bundled SmolLM2 target: one full training step (target forward
under no_grad + head forward/backward + optimizer step) against one target forward on the same batch.

    python scripts/experiments/training/bench_train_step.py [--kind eagle3] [--seq 512] [--batch 2] [--ttt-steps 7] [--repeats 5]

Prints a markdown table; the ratio is measured in one process on the same batch (goal: step <= 1.5x forward).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile

import torch

from drafttrain.config import Eagle3Config, EagleConfig
from drafttrain.decoding.autodepth import median_time
from drafttrain.drafts import build_drafter
from drafttrain.targets import load_target, run_target


def reduced_vocab_file(size: int, vocab: int) -> str:
    """A d2t/t2d mapping keeping the first ``size`` ids (the cost is what matters here, not which ids)."""
    from safetensors.torch import save_file

    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:size] = True
    path = tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False).name
    save_file({"d2t": torch.zeros(size, dtype=torch.long), "t2d": t2d}, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--kind", choices=["eagle3", "eagle"], default="eagle3")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocab size (top ids)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    if args.kind == "eagle3":
        cfg = Eagle3Config(ttt_steps=args.ttt_steps, draft_vocab=reduced_vocab_file(args.draft_vocab, target.vocab_size))
    else:
        cfg = EagleConfig()
    head = build_drafter(cfg, target).train().to(dtype=target.model.dtype)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq), generator=g).to(target.device)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}

    def forward_only():
        with torch.no_grad():
            target.model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False)
        sync()

    def train_step():
        out = head.training_step(batch, run_target(target, batch, head.needs()))  # the frozen target builds no graph
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        sync()

    def sync():
        if target.device.type == "cuda":
            torch.cuda.synchronize()

    t_forward = median_time(forward_only, args.repeats)
    if target.device.type == "cuda":  # the step's peak on top of what the target and head hold
        torch.cuda.reset_peak_memory_stats()
    t_step = median_time(train_step, args.repeats)
    peak_mib = torch.cuda.max_memory_allocated() / 2**20 if target.device.type == "cuda" else None
    tokens = args.batch * args.seq
    result = {
        "kind": args.kind, "ttt_steps": args.ttt_steps if args.kind == "eagle3" else 1, "batch": args.batch,
        "seq": args.seq, "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
        "target_forward_s": t_forward, "train_step_s": t_step, "step_over_forward": t_step / t_forward,
        "train_tokens_per_s": tokens / t_step, "trainable_parameters": sum(p.numel() for p in head.parameters()),
        "peak_allocated_mib": peak_mib,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    print("| kind | batch×seq | target forward | training step | step / forward | tokens/s |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.kind} (TTT {result['ttt_steps']}) | {args.batch}×{args.seq} | {t_forward * 1e3:.0f} ms | "
          f"{t_step * 1e3:.0f} ms | {t_step / t_forward:.2f}× | {tokens / t_step:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
