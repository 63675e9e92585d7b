"""A kind is one registry entry: a toy kind defined here, in the test file alone (its recipe section, its Drafter
class and the proposer that serves it), trains from a recipe, is evaluated at every checkpoint, exports with a
model card and loads back, with no edit anywhere else. docs/ARCHITECTURE.md's "Adding a kind" lists these steps.

The toy: a linear head on the target's final hidden state predicting the token after next (one Medusa-like head,
the target's own lm_head as its start), served as a one-token chain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from conftest import REPO
from torch import nn

from drafttrain.commands import main
from drafttrain.config import DraftConfig
from drafttrain.decoding import PROPOSERS, Chain, Draft, Proposer, register_proposer
from drafttrain.decoding.proposers import trained_draft
from drafttrain.drafts.base import Drafter, StepOutput, read_draft_config, top1_hits
from drafttrain.drafts.codecs import Codec, Exported, register_codecs
from drafttrain.drafts.losses import cross_entropy
from drafttrain.drafts.registry import KINDS, register_kind, unregister_kind
from drafttrain.targets import TargetNeeds


# 1. its section of the recipe schema
class ToyConfig(DraftConfig):
    kind: Literal["toy_skip"] = "toy_skip"
    init_from_target: bool = True


# 2. the class that says everything about it
class ToySkipDrafter(Drafter):
    kind = "toy_skip"
    config_class = ToyConfig
    proposer = "toy_skip"
    description = "a linear head on the target's last hidden state that predicts the token after next"

    def __init__(self, config: ToyConfig, hidden_size: int, vocab_size: int):
        super().__init__(config)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    @classmethod
    def target_needs(cls, config, target) -> TargetNeeds:
        return TargetNeeds(final_hidden=True)

    @classmethod
    def build(cls, config, target, run=None) -> "ToySkipDrafter":
        drafter = cls(config, target.hidden_size, target.vocab_size).to(target.device).attach_target(target)
        if config.init_from_target:
            with torch.no_grad():
                drafter.head.weight.copy_(target.model.get_output_embeddings().weight)
        return drafter

    @classmethod
    def from_pretrained(cls, directory, target, config=None) -> "ToySkipDrafter":
        config = ToyConfig.model_validate((config or read_draft_config(directory))["drafttrain"]["draft"])
        drafter = cls(config, target.hidden_size, target.vocab_size)
        drafter.load_weights(directory)
        return drafter.to(target.device).attach_target(target)

    @classmethod
    def max_draft_depth(cls, config) -> int:
        return 1

    def interchange_config(self) -> dict:
        return {"architectures": ["ToySkipHead"], "hidden_size": self.target.hidden_size,
                "vocab_size": self.target.vocab_size}

    def training_step(self, batch, outputs) -> StepOutput:
        ids, mask = batch["input_ids"], batch["loss_mask"].float()
        logits = self.head(outputs.final[:, :-2].to(self.head.weight.dtype))  # state t predicts token t+2
        labels, weight = ids[:, 2:], mask[:, 2:]
        loss = cross_entropy(logits, labels, weight)
        correct, counted = top1_hits(logits.argmax(-1), labels, weight)
        return StepOutput(loss=loss, metrics={"loss_0": float(loss.detach())}, correct=[correct], counted=[counted])


# 3. its serving format: a codec (the checkpoint's own layout, named vllm here)
class ToyVllm(Codec):
    fmt = "vllm"
    engines = {"vllm": "toy_skip"}  # how vLLM would be told to serve it (the card's command)

    def write(self, drafter: ToySkipDrafter) -> Exported:
        return Exported(drafter.checkpoint_config(export={"format": self.fmt}), drafter.state_tensors())

    def read(self, config, tensors):
        return config, tensors


# 4. the proposer that serves it
class ToySkipProposer(Proposer):
    shapes = (Chain,)
    max_depth = 1

    def __init__(self, target, *, draft=None):
        self.head = trained_draft(self.name, target, draft)
        self.hidden_layers = [target.num_layers]

    def prefill(self, input_ids, hidden, next_token) -> None:
        self.last, self.device = hidden[:, -1], input_ids.device

    def propose(self, request) -> Draft:
        if request.shape.depth == 0:
            return Draft.empty(self.device)
        return Draft.chain(self.head.head(self.last.to(self.head.head.weight.dtype)).argmax(-1)[:, None])

    def accept(self, tokens, hidden) -> None:
        self.last = hidden[:, -1]


# 5. its registry entry (here inside a fixture that takes it out again, so that the tests sharing this process,
# such as the recipe reference's, see the built-in kinds alone)
@pytest.fixture(autouse=True, scope="module")
def toy_kind_registered():
    register_kind(ToySkipDrafter)
    register_codecs(ToySkipDrafter, [ToyVllm()])
    register_proposer("toy_skip")(ToySkipProposer)
    yield
    unregister_kind("toy_skip")
    PROPOSERS.pop("toy_skip")


def test_the_toy_kind_is_registered_with_its_section():
    assert KINDS["toy_skip"] is ToySkipDrafter
    with pytest.raises(Exception, match="registered already"):
        register_kind(type("Other", (ToySkipDrafter,), {}))


@pytest.mark.slow
def test_a_kind_defined_in_a_test_trains_evaluates_exports_and_gets_a_card(tmp_path, restore_threads):
    torch.set_num_threads(1)
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "target": {"model": "smollm2-135m-instruct"},
        "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 8}],
                 "num_samples": 8, "validation_fraction": 0.25, "max_length": 64},
        "draft": {"kind": "toy_skip"},
        "training": {"max_steps": 4, "learning_rate": 1e-4, "save_every": 4, "log_every": 2},
        "eval": {"suite": "mt_bench", "num_prompts": 1, "max_new_tokens": 8, "depth": 1},
        "wandb": {"mode": "disabled"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["prepare", str(path), "--no-progress"]) == 0
    assert main(["train", str(path)]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004"
    measured = json.loads((checkpoint / "eval" / "report.json").read_text())
    assert measured["config"]["proposer"] == "toy_skip" and measured["overall"]["greedy_match"] == 1.0

    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--format", "vllm", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert ToySkipDrafter.description in card and '"method": "toy_skip"' in card
    assert "Not measured" not in card  # the checkpoint's own evaluation is its table

    assert main(["eval", "--target", "smollm2-135m-instruct", "--draft", str(out), "--num-prompts", "1",
                 "--turns", "1", "--max-new-tokens", "8", "--depth", "1", "--no-progress", "--strict",
                 "--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["config"]["draft"]["kind"] == "toy_skip" and report["overall"]["greedy_match"] == 1.0
    assert Path(report["config"]["draft"]["path"]) == out
