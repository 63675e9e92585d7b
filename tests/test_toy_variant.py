"""A variant is a subclass of its kind, registered beside it: a toy variant of EAGLE-3 defined here, in the test file
alone, is what a recipe's section selects, trains through its own training step, is saved, exported with its own
card notes and loaded back as itself, and is served by the kind's proposer, with no edit anywhere else. Taken out of
the registry again, the same files load as the kind's own class.

The toy: an EAGLE-3 head for sections that weigh every unrolled step alike (step_decay 1.0), which says so on its
model card and in its training metrics."""

from __future__ import annotations

import pytest
import torch
from test_dflash import batch_of, randomised
from test_export import tiny_target

from drafttrain.config import Eagle3Config
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.drafts import build_drafter, drafter_for, load_drafter
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.registry import register_variant, unregister_variant
from drafttrain.export import export_draft
from drafttrain.targets import run_target

FLAT = "every unrolled step weighs the same in its loss (step_decay 1.0)"


class FlatStepsEagle3(Eagle3Drafter):
    @classmethod
    def serves(cls, config: Eagle3Config) -> bool:
        return config.step_decay == 1.0

    def card_notes(self) -> list[str]:
        return [*super().card_notes(), f"A flat-steps head: {FLAT}."]

    def training_step(self, batch, outputs):
        out = super().training_step(batch, outputs)
        out.metrics["flat_steps"] = float(self.config.ttt_steps)
        return out


@pytest.fixture
def flat_variant():
    register_variant(FlatStepsEagle3)
    yield FlatStepsEagle3
    unregister_variant(FlatStepsEagle3)


def test_the_section_selects_the_variant_and_the_kind_keeps_the_others(flat_variant):
    assert drafter_for(Eagle3Config(step_decay=1.0)) is flat_variant
    assert drafter_for(Eagle3Config()) is Eagle3Drafter


def test_the_variant_trains_saves_exports_and_loads_back_as_itself(flat_variant, tmp_path):
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(step_decay=1.0, ttt_steps=2), target)).train()
    assert type(drafter) is flat_variant and drafter.kind == "eagle3"
    batch = batch_of(target)
    out = drafter.training_step(batch, run_target(target, batch, drafter.needs()))
    out.loss.backward()
    assert out.metrics["flat_steps"] == 2.0 and torch.isfinite(out.loss)
    checkpoint = drafter.eval().save_pretrained(tmp_path / "checkpoint")
    export = export_draft(checkpoint, "vllm", tmp_path / "export", target)
    assert FLAT in (export / "README.md").read_text()
    for folder in (checkpoint, export):
        loaded = load_drafter(folder, target)
        assert type(loaded) is flat_variant
        torch.testing.assert_close(loaded.state_dict()["fc.weight"], drafter.state_dict()["fc.weight"])

    prompt = batch["input_ids"][:1, :8]
    proposer = build_proposer("eagle", target, draft=drafter)  # the kind's proposer serves its variant
    out = SpeculativeDecoder(target, proposer, depth=3).generate(prompt, 12)
    assert out.tokens == plain_decode(target, prompt, 12).tokens  # greedy: the target's own tokens


def test_without_the_variant_registered_its_files_load_as_the_kind(tmp_path):
    target = tiny_target()
    register_variant(FlatStepsEagle3)
    try:
        checkpoint = build_drafter(Eagle3Config(step_decay=1.0), target).save_pretrained(tmp_path / "checkpoint")
    finally:
        unregister_variant(FlatStepsEagle3)
    assert type(load_drafter(checkpoint, target)) is Eagle3Drafter
