"""How an export says it is served: vLLM's speculative config comes from the format's codec (parallel drafting for
P-EAGLE and PARD), and the kind's notes reach the card's "Serve it" in every format it is written in (DFlash and
P-EAGLE are written in speculators' format only)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from families import family_model

from drafttrain.config import parse_recipe
from drafttrain.drafts import build_drafter
from drafttrain.drafts.codecs import codecs_of
from drafttrain.export.writer import export_draft
from drafttrain.targets import Target, load_tokenizer

SECTIONS = {
    "eagle3": ({"kind": "eagle3", "layers": [1, 2, 3]}, "vllm", {"method": "eagle3"}),
    "peagle": ({"kind": "eagle3", "layers": [1, 2, 3], "parallel": {"depths": 4}}, "speculators",
               {"method": "eagle3", "parallel_drafting": True}),
    "draft_model": ({"kind": "draft_model", "cut": "every:2"}, "hf", {"method": "draft_model"}),
    "pard": ({"kind": "draft_model", "cut": "every:2", "parallel": {"depths": 4}}, "hf",
             {"method": "draft_model", "parallel_drafting": True}),
    "dflash": ({"kind": "dflash", "block_size": 4, "num_layers": 2}, "speculators", {"method": "dflash"}),
    "medusa2": ({"kind": "medusa", "num_heads": 2, "target_lora": {"target_modules": ["q_proj"], "rank": 4}}, "vllm",
                {"method": "medusa"}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.mark.parametrize("name", SECTIONS)
def test_the_card_serves_the_draft_with_its_formats_config_and_the_kinds_notes(name, tokenizer, tmp_path):
    section, fmt, speculative = SECTIONS[name]
    target = Target("llama", family_model("llama"), tokenizer)
    torch.manual_seed(0)
    drafter = build_drafter(parse_recipe({"draft": section}).draft, target)
    serving = codecs_of(type(drafter))[fmt].serving(drafter)["vllm"]
    assert {"method": serving.method, **serving.options} == speculative
    export = export_draft(drafter.save_pretrained(tmp_path / "checkpoint"), fmt, tmp_path / fmt, target)
    serve_it = (export / "README.md").read_text().split("## Serve it")[1].split("\n## ")[0]
    assert all(note in serve_it for note in drafter.card_notes())
    if fmt in ("vllm", "hf"):  # the command names the speculative config (speculators': vLLM reads its own)
        given = json.loads(re.search(r"--speculative-config '(\{.*?\})'", serve_it).group(1))
        assert {k: v for k, v in given.items() if k not in ("model", "num_speculative_tokens")} == speculative


def test_the_kinds_with_notes_for_their_users_are_those_measured_above(tokenizer):
    """DFlash, P-EAGLE, PARD and Medusa-2 each say something beyond the command: the test above reads it in their
    cards (so a note no card shows fails there)."""
    target = Target("llama", family_model("llama"), tokenizer)
    with_notes = {name for name, (section, _, _) in SECTIONS.items()
                  if build_drafter(parse_recipe({"draft": section}).draft, target).card_notes()}
    assert with_notes == {"peagle", "pard", "dflash", "medusa2"}
