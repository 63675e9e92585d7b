"""Exports for targets of other families, as the engines read them: EAGLE-3 heads for MoE (Qwen3-MoE, gpt-oss,
Llama 4), MLA (DeepSeek-V3 / Kimi-K2), sliding-window (Gemma 3), recurrent (Qwen3-Next) and convolution (LFM2)
targets in every format the kind writes, DFlash drafts for Qwen3 and Qwen3.5, each with the layers it reads, the
vocabulary sizes and the target's architecture recorded, and loaded back weight for weight."""

from __future__ import annotations

import json

import pytest
import torch
from families import FAMILIES, family_model
from safetensors.torch import load_file

from drafttrain.config import parse_recipe
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.codecs import codecs_of
from drafttrain.export.writer import export_draft
from drafttrain.targets import Target, load_tokenizer

EAGLE3_TARGETS = ["qwen3_moe", "gpt_oss", "llama4", "deepseek_v3", "gemma3", "qwen3_next", "lfm2"]
DFLASH_TARGETS = ["qwen3", "qwen3_5"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


def trained_looking(drafter):
    """Every parameter random, so a dropped or misplaced tensor shows."""
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    return drafter.eval()


def same_weights(a, b) -> None:
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name


def exported(drafter, target, tmp_path, fmt: str):
    checkpoint = drafter.save_pretrained(tmp_path / "checkpoint")
    folder = export_draft(checkpoint, fmt, tmp_path / fmt, target)
    return folder, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def check_target_recorded(config: dict, target: Target) -> None:
    recorded = config["drafttrain"]["target"]
    assert recorded["model_type"] == FAMILIES[target.name][0]
    assert recorded["architectures"] == target.model.config.architectures or \
        recorded["architectures"] == [type(target.model).__name__]
    assert (recorded["vocab_size"], recorded["hidden_size"], recorded["num_hidden_layers"]) == \
        (target.vocab_size, target.hidden_size, target.num_layers)


@pytest.mark.parametrize("family", EAGLE3_TARGETS)
def test_an_eagle3_head_exports_in_every_format_and_loads_back(family, tokenizer, tmp_path):
    target = Target(family, family_model(family), tokenizer)
    section = parse_recipe({"draft": {"kind": "eagle3", "layers": [1, 2, 3]}}).draft
    drafter = trained_looking(build_drafter(section, target))
    for fmt in codecs_of(type(drafter)):
        folder, config, tensors = exported(drafter, target, tmp_path / fmt, fmt)
        check_target_recorded(config, target)
        if fmt == "speculators":
            assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
            assert config["speculators_config"]["verifier"]["architectures"] == \
                list(target.model.config.architectures or [])
        else:  # vLLM reads HF's numbering (the input of layer i); SGLang the output of layer i - 1
            ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            assert ids == ([1, 2, 3] if fmt == "vllm" else [0, 1, 2])
        assert config["target_hidden_size"] == target.hidden_size
        assert config["draft_vocab_size"] == target.vocab_size and config.get("vocab_size", target.vocab_size) == \
            target.vocab_size
        assert tensors["fc.weight"].shape == (target.hidden_size, 3 * target.hidden_size)
        back = load_drafter(folder, target)
        assert back.layer_ids == [1, 2, 3]
        same_weights(drafter, back)


@pytest.mark.parametrize("family", DFLASH_TARGETS)
def test_a_dflash_draft_exports_in_every_format_and_loads_back(family, tokenizer, tmp_path):
    target = Target(family, family_model(family), tokenizer)
    drafter = trained_looking(build_drafter(parse_recipe({"draft": {"kind": "dflash"}}).draft, target))
    for fmt in codecs_of(type(drafter)):
        folder, config, tensors = exported(drafter, target, tmp_path / fmt, fmt)
        check_target_recorded(config, target)
        back = load_drafter(folder, target)
        assert back.layer_ids == drafter.layer_ids
        same_weights(drafter, back)


def test_an_moe_target_trains_is_measured_at_every_checkpoint_and_serves_its_export(tmp_path, moe_folder_target):
    """A Qwen3-MoE target through the commands a user runs: prepare, train (each checkpoint evaluated on held-out
    prompts, exactly lossless), export for vLLM, and `drafttrain eval` of the export."""
    from conftest import small_recipe

    from drafttrain.commands import main

    recipe = small_recipe(tmp_path, {"kind": "eagle3", "ttt_steps": 2}, target={"model": str(moe_folder_target)},
                          training={"max_steps": 4, "save_every": 2, "log_every": 1},
                          eval={"every_checkpoint": True, "num_prompts": 2, "max_new_tokens": 8, "depth": 2})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    for step in (2, 4):
        report = json.loads((run / "checkpoints" / f"step-{step:06d}" / "eval" / "report.json").read_text())
        assert report["overall"]["greedy_match"] == 1.0 and report["overall"]["tau"] >= 1.0
    assert main(["export", str(run), "--format", "vllm", "--out", str(tmp_path / "export")]) == 0
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["drafttrain"]["target"]["model_type"] == "qwen3_moe"
    assert main(["eval", "--target", str(moe_folder_target), "--draft", str(tmp_path / "export"), "--turns", "1",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--depth", "2", "--strict", "--no-progress",
                 "--out", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["overall"]["greedy_match"] == 1.0
