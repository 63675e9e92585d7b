"""TRL's GKD trainer on the rows, student and teacher that scripts/experiments/parity/gkd_inputs.py wrote, for a given training
time; run with the TRL venv's Python (scripts/experiments/parity/distill.sh does).

    .venvs/trl/bin/python scripts/experiments/parity/gkd.py INPUTS OUT --minutes 10 [--seed 0] [--lmbda 0.5] [--beta 0.5]
        [--lr 1e-4] [--threads 2]

TRL has no time budget, only ``max_steps``: a short calibration run measures its seconds per optimizer step (from the
end of its first step: the first pays for setting up), and the real run gets the steps that fill ``--minutes``, with
the cosine schedule spread over exactly those steps (a callback also stops it at 1.1x the minutes). The settings
drafttrain's recipe (scripts/experiments/parity/distill.yaml) fixes are given to GKDConfig (batch 2 x 2 accumulation, AdamW at
--lr (1e-4) without weight decay, 20 warm-up steps then cosine, clipping at 0.5, fp32, beta, lmbda, sampling at
temperature 1 up to 128 new tokens, and no gradient checkpointing: TRL's SFT default turns it on, which recomputes
the student and makes GKD generate without a KV cache, neither of which drafttrain does and which a 50M student on a
CPU does not need); everything else is TRL's default. TRL's own ChatML collator trains the last assistant turn only
and re-tokenises the messages; to train on drafttrain's rows token for token, a collator here gives GKD those rows:
labels where drafttrain's loss mask is set, and as on-policy prompts each row up to its first trained token
(left-padded), as drafttrain does.
Written to OUT: model/ (the student, with the inputs' tokenizer files), run.json, train.log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl.experimental.gkd import GKDConfig, GKDTrainer


def digest(ids, mask) -> str:  # as scripts/experiments/parity/features.py's row_digest (this venv has no drafttrain)
    return hashlib.sha256(json.dumps([list(map(int, ids)), list(map(int, mask))]).encode()).hexdigest()


def read_rows(path: Path) -> Dataset:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    bad = [i for i, r in enumerate(rows) if digest(r["input_ids"], r["loss_mask"]) != r["sha256"]]
    if bad:
        raise SystemExit(f"{len(bad)} rows do not match their sha256 (first: row {bad[0]})")
    return Dataset.from_list([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])


class RowCollator:
    """drafttrain's rows as GKD's inputs: right-padded ids, labels on the trained tokens, left-padded prompts."""

    def __init__(self, pad: int):
        self.pad = pad

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        prompts = [r["input_ids"][: max(r["loss_mask"].index(1) if 1 in r["loss_mask"] else len(r["loss_mask"]), 1)]
                   for r in rows]
        prompt_width = max(len(p) for p in prompts)
        out = {"input_ids": torch.full((len(rows), width), self.pad), "attention_mask": torch.zeros(len(rows), width,
               dtype=torch.long), "labels": torch.full((len(rows), width), -100),
               "prompts": torch.full((len(rows), prompt_width), self.pad),
               "prompt_attention_mask": torch.zeros(len(rows), prompt_width, dtype=torch.long)}
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            ids, mask, n = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]), len(row["input_ids"])
            out["input_ids"][i, :n], out["attention_mask"][i, :n] = ids, 1
            out["labels"][i, :n] = torch.where(mask.bool(), ids, -100)
            out["prompts"][i, prompt_width - len(prompt):] = torch.tensor(prompt)
            out["prompt_attention_mask"][i, prompt_width - len(prompt):] = 1
        return out


class CountingGKD(GKDTrainer):
    """GKDTrainer unchanged, counting the tokens each loss reads (on-policy answers included) for tokens/s."""

    tokens = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.tokens += int(inputs["attention_mask"].sum())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class StopAfter(TrainerCallback):
    """Stops training after ``seconds``; keeps the time at the end of every optimizer step."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start, self.ends = seconds, time.perf_counter(), []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        if self.seconds is not None and self.ends[-1] - self.start > self.seconds:
            control.should_training_stop = True


def train(args, steps: int, out: Path, seconds: float | None = None) -> CountingGKD:
    tokenizer = AutoTokenizer.from_pretrained(args.inputs / "student")
    config = GKDConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=min(20, steps), weight_decay=0.0,
        max_grad_norm=0.5, lmbda=args.lmbda, beta=args.beta, temperature=1.0, max_new_tokens=128, seed=args.seed,
        logging_steps=25, save_strategy="no", report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0,
        gradient_checkpointing=False)  # TRL's SFT default is on; it would recompute the student and generate
    # without a KV cache (GKD turns the cache off under checkpointing), which drafttrain does neither of
    student = AutoModelForCausalLM.from_pretrained(args.inputs / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.inputs / "teacher", dtype=torch.float32)
    trainer = CountingGKD(model=student, teacher_model=teacher, args=config, train_dataset=args.rows,
                          processing_class=tokenizer, data_collator=RowCollator(tokenizer.pad_token_id or 0),
                          callbacks=[clock := StopAfter(seconds)])
    started = time.perf_counter()
    trainer.train()
    trainer.wall_s = time.perf_counter() - started
    trainer.step_ends = clock.ends
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lmbda", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibrate-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.rows = read_rows(args.inputs / "rows.jsonl")
    calibration = train(args, args.calibrate_steps, args.out / "calibration")
    ends = calibration.step_ends  # the first step's setup left out: it overestimated the time a step takes
    per_step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else calibration.wall_s
    steps = max(1, int(args.minutes * 60 / per_step))
    print(f"calibration: {per_step:.2f} s a step -> {steps} steps for {args.minutes} minutes", flush=True)
    trainer = train(args, steps, args.out / "trl", seconds=1.1 * args.minutes * 60)
    trainer.model.save_pretrained(args.out / "model", safe_serialization=True)
    for name in (args.inputs / "student").iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, args.out / "model" / name.name)
    record = {"trainer": "trl GKDTrainer", "steps": trainer.state.global_step, "planned_steps": steps,
              "wall_s": trainer.wall_s, "tokens": trainer.tokens, "tokens_per_s": trainer.tokens / trainer.wall_s,
              "seed": args.seed, "lmbda": args.lmbda, "beta": args.beta, "lr": args.lr, "threads": args.threads,
              "rows": len(args.rows),
              "log": trainer.state.log_history}
    (args.out / "run.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "log"}))


if __name__ == "__main__":
    main()
