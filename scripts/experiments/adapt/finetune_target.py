"""A changed target for SmolLM2-135M-Instruct fine-tuned with a peft LoRA adapter on Alpaca's written
answers (LLaMA-Factory's alpaca_en_demo, 999 rows; Apache-2.0 repo, CC BY-NC 4.0 content; data/SOURCES.md), the
kind of fine-tune a user serves, so that a head trained for the base meets answers in another style.

    python scripts/experiments/adapt/finetune_target.py OUT [--minutes 10] [--rows 600]

Loss on the assistant turns only (drafttrain's own tokenisation and masks), AdamW, one pass or the time budget.
OUT is a peft adapter folder: the target is then ``smollm2-135m-instruct+OUT`` (or ``target.adapter: OUT``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from drafttrain.config import DataConfig, SourceConfig
from drafttrain.data.sources import load_mixture
from drafttrain.data.tokenize import build_tokenized_dataset
from drafttrain.targets import load_target

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "data" / "train" / "alpaca_en_demo.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_target("smollm2-135m-instruct")
    data = DataConfig(sources=[SourceConfig(path=str(DATA))], num_samples=args.rows, validation_fraction=0.0,
                      max_length=args.max_length)
    mixture = load_mixture(data, seed=0)
    rows, _ = build_tokenized_dataset(mixture.train, target.tokenizer, data, Path(args.out) / "cache")
    model = get_peft_model(target.model.train(), LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    start, losses, seen = time.perf_counter(), [], 0
    for row in rows.shuffle(seed=0):
        ids = torch.tensor([row["input_ids"]])
        labels = torch.where(torch.tensor([row["loss_mask"]]) > 0, ids, torch.full_like(ids, -100))
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        seen += 1
        if seen % 50 == 0:
            print(f"row {seen}: loss {sum(losses[-50:]) / 50:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
        if time.perf_counter() - start > args.minutes * 60:
            break
    model.save_pretrained(args.out)
    first, last = losses[:50], losses[-50:]
    summary = {"rows": seen, "seconds": round(time.perf_counter() - start, 1), "first_50_loss": sum(first) / len(first),
               "last_50_loss": sum(last) / len(last), "data": str(DATA.relative_to(REPO)),
               "lora": {"r": 16, "alpha": 32, "modules": "q,k,v,o,gate,up,down"}, "lr": args.lr}
    (Path(args.out) / "finetune.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
