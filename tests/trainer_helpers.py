"""Fixtures for the trainer tests: a tiny random Llama target, a stand-in draft head with the draft interface
(a real next-token loss through the target's frozen lm_head), and a small tokenised dataset with learnable
structure. Also a script: the DeepSpeed tests run it under ``accelerate launch`` and read what each rank wrote.

The stand-in is a fixture for the trainer, not a mock of the EAGLE heads (those have their own tests): it has
dropout (so resume must restore RNG state to reproduce losses) and can be told to produce a NaN loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when run as a script by accelerate launch
    sys.path.insert(0, str(REPO))

from drafttrain.config import DraftConfig, Recipe, parse_recipe  # noqa: E402
from drafttrain.data.tokenize import split_fingerprint  # noqa: E402
from drafttrain.drafts.base import Drafter, StepOutput, top1_hits  # noqa: E402
from drafttrain.targets import Target, TargetNeeds, TargetOutputs  # noqa: E402

VOCAB = 128
POISON_TOKEN = 127  # only in the row named "conv-poison"; the stand-in draft turns it into a NaN loss on request


def tiny_target(seed: int = 0) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Target("tiny-llama", LlamaForCausalLM(config).eval().requires_grad_(False), tokenizer=None)


class Interrupted(Exception):
    """Raised by a checkpoint callback to stop a run right after a checkpoint, like a preemption would."""


def prepared_run(folder: Path, dataset) -> Path:
    """``folder`` as prepare leaves a run: the tokenised train split and the data manifest that records it."""
    dataset.save_to_disk(str(folder / "data" / "train"))
    (folder / "data" / "manifest.json").write_text(json.dumps({"train": split_fingerprint(dataset)}))
    return folder


def tiny_dataset(num_rows: int = 48, seed: int = 0, poison_row: int | None = None):
    """Arithmetic progressions mod 120 (the next token is predictable from the context); the first 3 tokens
    are "prompt" (loss_mask 0). Lengths vary, so batches get padded."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": []}
    for i in range(num_rows):
        length = int(torch.randint(8, 17, (1,), generator=g))
        start, stride = int(torch.randint(0, 120, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = [(start + stride * t) % 120 for t in range(length)]
        if i == poison_row:
            ids[5] = POISON_TOKEN
        rows["id"].append("conv-poison" if i == poison_row else f"conv-{i}")
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0, 0, 0] + [1] * (length - 3))
    return datasets.Dataset.from_dict(rows)


class StandInDraft(Drafter):
    """Predicts token t+1 from the target's tapped hidden states at t plus the target's (frozen, referenced)
    embedding of token t, with its own small output head."""

    kind = "stand-in"

    def __init__(self, target: Target, layers=(1, 2), dropout: float = 0.1, nan_on_poison: bool = False,
                 nan_weights_at_call: int | None = None):
        super().__init__(DraftConfig(kind=self.kind))
        self.attach_target(target)  # referenced, not registered: not trained, not saved
        self.layers = list(layers)
        self.nan_on_poison = nan_on_poison
        hidden = target.hidden_size
        self.fc = nn.Linear(len(self.layers) * hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, target.vocab_size)
        self.dropout = nn.Dropout(dropout)
        self.dropout_p = dropout
        # A weight the loss never reads: set to NaN on the given call, the weights go bad while the loss stays finite.
        self.spare = nn.Parameter(torch.zeros(1))
        self.nan_weights_at_call, self.calls = nan_weights_at_call, 0

    def needs(self) -> TargetNeeds:
        return TargetNeeds(layers=tuple(self.layers))

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        h = self.fc(outputs.hidden) + self.target.model.get_input_embeddings()(batch["input_ids"])
        h = h + self.mlp(self.dropout(h))
        logits = self.head(h)[:, :-1]
        labels = batch["input_ids"][:, 1:]
        weight = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].float()
        per_token = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (per_token * weight.reshape(-1)).sum() / weight.sum().clamp(min=1)
        if self.nan_on_poison and bool((batch["input_ids"] == POISON_TOKEN).any()):
            loss = loss * float("nan")
        self.calls += 1
        if self.calls == self.nan_weights_at_call:
            with torch.no_grad():
                self.spare.fill_(float("nan"))
        with torch.no_grad():
            correct, counted = top1_hits(logits.argmax(-1), labels, weight)
        return StepOutput(loss=loss, metrics={"loss_0": float(loss.detach())},
                          correct=[correct], counted=[counted])

    def save_pretrained(self, directory) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"kind": "stand-in", "layers": self.layers,
                                                           "dropout": self.dropout_p}))
        return directory

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "StandInDraft":
        config = config or json.loads((Path(directory) / "config.json").read_text())
        draft = cls(target, layers=config["layers"], dropout=config["dropout"])
        draft.load_state_dict(load_file(str(Path(directory) / "model.safetensors")))
        return draft


def unequal_rows():
    """Two rows with 2 and 14 trained tokens: under loss_reduction "micro_batch", one row a micro-batch gives the
    short row's tokens 7 times the weight of the long row's; under "token" every trained token weighs alike."""
    import datasets

    return datasets.Dataset.from_dict({"id": ["short", "long"], "input_ids": [[5, 7, 9, 11, 13], list(range(2, 19))],
                                       "loss_mask": [[0, 0, 0, 1, 1], [0, 0, 0] + [1] * 14]})


def one_step_on_unequal_rows(output_dir, **training):
    """One optimizer step of the stand-in (no dropout, no clipping to speak of) on unequal_rows, in row order;
    returns the trainer, whose grad_norm is the step's gradient norm before clipping."""
    trainer = make_trainer(output_dir, dataset=unequal_rows(), draft_kwargs={"dropout": 0.0}, max_steps=1,
                           group_by_length=False, max_grad_norm=1e6, **training)
    trainer.train()
    return trainer


def tiny_recipe(output_dir, **training) -> Recipe:
    settings = {"batch_size": 4, "learning_rate": 1e-2, "scheduler": "cosine", "warmup_steps": 1, "log_every": 1,
                "save_every": 100, "keep_last": 2, "max_grad_norm": 1.0, **training}
    return parse_recipe({"output_dir": str(output_dir), "seed": 0, "training": settings, "wandb": {"enabled": False}})


def make_trainer(output_dir, dataset=None, draft_kwargs=None, callbacks=None, best_metric=None, **training):
    from drafttrain.training.trainer import Trainer

    target = tiny_target()
    torch.manual_seed(1)  # the draft's initial weights, the same in every trainer of a test
    draft = StandInDraft(target, **(draft_kwargs or {}))
    dataset = dataset if dataset is not None else tiny_dataset()
    return Trainer(tiny_recipe(output_dir, **training), target, draft, dataset, callbacks=callbacks,
                   best_metric=best_metric)


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """Use with ``pytestmark = pytest.mark.usefixtures("fresh_accelerate")``: no wandb, fresh accelerate state."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    reset_accelerate()
    yield
    reset_accelerate()


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; each in-process trainer in a test needs a fresh one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main() -> int:
    """Train the stand-in draft; each rank writes rank-<i>.json with its view of the run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--deepspeed")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--rewind-to", type=int, metavar="STEP",
                        help="afterwards, copy the run to <output_dir>-resumed without the checkpoints after STEP "
                             "(as if killed then) and resume it with a new Trainer in the same processes")
    parser.add_argument("--reduction-probe", action="store_true",
                        help="last, one step on unequal_rows per loss_reduction, one row a process; each rank writes "
                             "rank-<i>-reduction.json with the steps' gradient norms")
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = {"max_steps": args.max_steps, "save_every": args.save_every, "batch_size": 2}
    if args.deepspeed:
        overrides["deepspeed"] = args.deepspeed
    output_dir = Path(args.output_dir)
    trainer = make_trainer(output_dir, **overrides)
    _report(trainer, trainer.train(resume=args.resume), output_dir / f"rank-{trainer.accelerator.process_index}.json")
    _probe(trainer, output_dir / f"rank-{trainer.accelerator.process_index}-probe.safetensors")
    if args.rewind_to is not None:
        # every rank's probe file is complete before rank 0 copies the folder (safetensors writes through a
        # hidden temporary file that vanishes under a copy that starts early)
        trainer.accelerator.wait_for_everyone()
        rewound = output_dir.with_name(output_dir.name + "-resumed")
        if trainer.accelerator.is_main_process:
            _rewind_copy(output_dir, rewound, args.rewind_to)
        trainer.accelerator.wait_for_everyone()
        reset_accelerate()  # a new Trainer, as in a fresh process (the process group itself stays up)
        trainer = make_trainer(rewound, **overrides)
        _report(trainer, trainer.train(resume=True), rewound / f"rank-{trainer.accelerator.process_index}.json")
    if args.reduction_probe:
        _reduction_probe(output_dir, args.deepspeed)
    return 0


def _reduction_probe(output_dir: Path, deepspeed: str | None) -> None:
    norms, rank = {}, 0
    for reduction in ("token", "micro_batch"):
        reset_accelerate()
        probe = one_step_on_unequal_rows(output_dir.with_name(f"{output_dir.name}-{reduction}"), batch_size=1,
                                         loss_reduction=reduction, **({"deepspeed": deepspeed} if deepspeed else {}))
        norms[reduction], rank = probe.grad_norm, probe.accelerator.process_index
        probe.accelerator.wait_for_everyone()
    (output_dir / f"rank-{rank}-reduction.json").write_text(json.dumps(norms))


def _report(trainer, result, path: Path) -> None:
    acc = trainer.accelerator
    from drafttrain.training.runtime import local_part

    held = sum(local_part(p).numel() for p in trainer.target.model.parameters())
    report = {"rank": acc.process_index, "world_size": acc.num_processes, "distributed_type": str(acc.distributed_type),
              "target_share": held / sum(getattr(p, "ds_numel", p.numel()) for p in trainer.target.model.parameters()),
              "steps": result.steps, "losses": {str(k): v for k, v in result.losses.items()},
              "resumed_from": str(result.resumed_from), "last_checkpoint": str(result.last_checkpoint)}
    path.write_text(json.dumps(report))
    acc.wait_for_everyone()


PROBE_IDS = torch.arange(14).reshape(2, 7) * 5 % VOCAB


def _probe(trainer, path: Path) -> None:
    """The target's taps and logits for PROBE_IDS, as this rank computes them after training (under ZeRO-3, from
    its partitioned weights: every rank runs it, the gathers are collective)."""
    from drafttrain.targets import run_target

    with torch.no_grad():
        out = run_target(trainer.target, {"input_ids": PROBE_IDS}, TargetNeeds(layers=(1, 2), logits=True))
    save_file({"hidden": out.hidden.contiguous().cpu(), "logits": out.logits.contiguous().cpu()}, str(path))


def _rewind_copy(source: Path, destination: Path, step: int) -> None:
    import shutil

    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("rank-*.json"))
    for ckpt in (destination / "checkpoints").glob("step-*"):
        if int(ckpt.name.removeprefix("step-")) > step:
            shutil.rmtree(ckpt)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    raise SystemExit(main())


def straight_and_resumed(make_trainer, root: Path, stop_step: int = 2):
    """Train once straight through; train again, stopped (an exception) after checkpoint ``stop_step`` and resumed.
    ``make_trainer(folder, callbacks)`` builds the same trainer each time. Returns both TrainResults."""

    class Stop(Exception):
        pass

    def stop(step, checkpoint):
        if step == stop_step:
            raise Stop

    straight = make_trainer(root / "straight", None).train()
    try:
        make_trainer(root / "resumed", [stop]).train()
    except Stop:
        pass
    else:
        raise AssertionError(f"training did not reach checkpoint {stop_step}")
    return straight, make_trainer(root / "resumed", None).train(resume=True)
