"""One name per idea in the recipe: parallel drafting is one sub-section (``parallel``) for P-EAGLE and PARD, LoRA
is ``draft_lora`` on a draft and ``target_lora`` on the target. A recipe in the earlier spellings is refused naming
the new key; a draft saved under them loads as it was trained."""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash import randomised, tiny_target

from drafttrain import DrafttrainError
from drafttrain.config import (
    DRAFT_SECTIONS,
    DraftLora,
    DraftModelConfig,
    Eagle3Config,
    LoraSettings,
    MedusaConfig,
    ParallelDrafting,
    StudentLora,
    TargetLora,
    parse_recipe,
)
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.continuation import continued_config
from drafttrain.drafts.saved import SavedDraft

CUT = {"kind": "draft_model", "cut": "first:2"}


@pytest.mark.parametrize("section, says", [
    ({"kind": "eagle3", "parallel_depths": 4}, "parallel_depths is now parallel.depths"),
    ({"kind": "eagle3", "cod_ratio": 0.5}, "cod_ratio is now parallel.cod_ratio"),
    ({**CUT, "parallel": 4}, "parallel is now a section: parallel: {depths: 4}"),
    ({**CUT, "mask_token_id": 5}, "mask_token_id is now parallel.mask_token_id"),
    ({**CUT, "lora": {"target_modules": ["q_proj"]}}, "lora is now draft_lora"),
    ({"kind": "medusa", "lora": {"target_modules": ["q_proj"]}}, "lora is now target_lora"),
])
def test_an_earlier_spelling_in_a_recipe_is_refused_naming_the_new_key(section, says):
    with pytest.raises(DrafttrainError) as err:
        parse_recipe({"draft": section})
    assert says in str(err.value) and "draft:" in str(err.value)


def test_each_idea_has_one_section_class_whichever_kind_uses_it():
    parallel = {s.model_fields["parallel"].annotation for s in DRAFT_SECTIONS if "parallel" in s.model_fields}
    assert parallel == {ParallelDrafting | None}  # P-EAGLE's and PARD's
    assert Eagle3Config.model_fields["draft_lora"].annotation == DraftLora | None
    assert DraftModelConfig.model_fields["draft_lora"].annotation == StudentLora | None
    assert MedusaConfig.model_fields["target_lora"].annotation == TargetLora | None
    assert all(issubclass(cls, LoraSettings) for cls in (DraftLora, StudentLora, TargetLora))
    lora_fields = {name for s in DRAFT_SECTIONS for name, f in s.model_fields.items()
                   if "Lora" in str(f.annotation)}
    assert lora_fields == {"draft_lora", "target_lora"}


def _as_saved_before_the_rename(section: dict) -> dict:
    """A section dump in the keys earlier drafttrain versions saved: flat parallel keys, ``lora``."""
    old = {key: value for key, value in section.items() if key not in ("parallel", "target_lora")}
    parallel = section.get("parallel") or {}
    depths_key = "parallel_depths" if section["kind"] == "eagle3" else "parallel"
    if section["kind"] in ("eagle3", "draft_model"):
        old.update({depths_key: parallel.get("depths", 0), "cod_ratio": parallel.get("cod_ratio", 0.7),
                    "cod_min": parallel.get("cod_min", 0.2), "mask_token_id": parallel.get("mask_token_id")})
    if section["kind"] == "draft_model":
        old["lora"], old["draft_lora"] = section["draft_lora"], None
    if section["kind"] == "medusa":
        old["lora"] = section["target_lora"]
    return old


@pytest.mark.parametrize("section", [
    Eagle3Config(), Eagle3Config(parallel={"depths": 4, "cod_ratio": 0.6, "mask_token_id": 7}),
    DraftModelConfig(cut="first:2", parallel={"depths": 3}),
    DraftModelConfig(cut="first:2", draft_lora={"target_modules": ["q_proj"], "rank": 4}),
    MedusaConfig(target_lora={"target_modules": ["q_proj"], "rank": 4}),
], ids=["eagle3", "peagle", "pard", "draft_model_lora", "medusa2"])
def test_a_section_saved_in_the_earlier_keys_reads_as_the_same_section(section):
    old = _as_saved_before_the_rename(section.model_dump())
    assert old != section.model_dump()
    assert type(section).from_saved(old) == section


def test_a_p_eagle_checkpoint_saved_in_the_earlier_keys_loads_with_its_parallel_settings(tmp_path):
    target = tiny_target()
    torch.manual_seed(0)
    drafter = randomised(build_drafter(Eagle3Config(parallel={"depths": 4, "cod_ratio": 0.6, "mask_token_id": 63},
                                                    ttt_steps=1), target))
    folder = drafter.save_pretrained(tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    config["drafttrain"]["draft"] = _as_saved_before_the_rename(config["drafttrain"]["draft"])
    assert "parallel_depths" in config["drafttrain"]["draft"]
    (folder / "config.json").write_text(json.dumps(config))
    assert SavedDraft.open(folder).section() == drafter.config
    loaded = load_drafter(folder, target)
    assert type(loaded) is type(drafter) and loaded.config.parallel == drafter.config.parallel
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))


@pytest.mark.parametrize("draft, change, said", [
    ({"parallel": {"depths": 3, "cod_ratio": 0.5}}, "draft.parallel.depths=4", "draft.parallel was"),
    ({}, "draft.ttt_steps=2", "draft.ttt_steps was 1, now 2"),
])
def test_a_run_saved_under_the_earlier_keys_resumes_and_still_refuses_a_real_change(tmp_path, capsys, folder_target,
                                                                                   draft, change, said):
    """A run trained before the renames could not --resume in either spelling: the recipe it saved was compared
    key by key without the upgrade loading applies ("draft.cod_ratio was 0.5, now None; draft.parallel was None")."""
    from conftest import small_recipe

    from drafttrain.commands import main

    recipe = small_recipe(tmp_path, {"kind": "eagle3", "ttt_steps": 1, "intermediate_size": 32, **draft},
                          target={"model": str(folder_target)}, training={"max_steps": 1, "save_every": 1},
                          eval={"every_checkpoint": False})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0 and main(["train", str(recipe)]) == 0
    manifest = tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json"
    written = json.loads(manifest.read_text())
    saved = written["built_from"]["recipe"]
    saved["draft"] = _as_saved_before_the_rename(saved["draft"])
    assert "parallel_depths" in saved["draft"] and "parallel" not in saved["draft"]
    manifest.write_text(json.dumps(written))
    capsys.readouterr()
    assert main(["train", str(recipe), "--resume", "--max-steps", "2", change]) == 2
    assert said in capsys.readouterr().err
    assert main(["train", str(recipe), "--resume", "draft.cod_ratio=0.5"]) == 2  # the earlier spelling: its new name
    assert "cod_ratio is now parallel.cod_ratio" in capsys.readouterr().err
    assert main(["train", str(recipe), "--resume", "--max-steps", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_a_continued_parallel_draft_may_change_its_cod_sampling_but_not_its_depths():
    saved = Eagle3Config(parallel={"depths": 4, "mask_token_id": 7})
    changed = continued_config(saved, Eagle3Config(init_from="runs/p", parallel={"depths": 4, "cod_ratio": 0.5}),
                               "runs/p")
    assert changed.parallel == ParallelDrafting(depths=4, cod_ratio=0.5, mask_token_id=7)
    with pytest.raises(DrafttrainError, match="draft.parallel.depths is 3 in the recipe, 4 in the draft"):
        continued_config(saved, Eagle3Config(init_from="runs/p", parallel={"depths": 3}), "runs/p")
    with pytest.raises(DrafttrainError, match="draft.parallel is .* in the recipe, None in the draft"):
        continued_config(Eagle3Config(), Eagle3Config(init_from="runs/p", parallel={"depths": 3}), "runs/p")


def test_a_draft_model_takes_draft_lora_when_built_and_refuses_it_when_continued():
    assert DraftModelConfig(cut="first:2", draft_lora={"target_modules": ["q_proj"]}).draft_lora.dropout == 0.05
    with pytest.raises(ValueError, match="a continued draft model .* trains all its weights"):
        DraftModelConfig(cut="first:2", init_from="runs/d", draft_lora={"target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="name it in draft.init_from"):
        Eagle3Config(draft_lora={"rank": 4})


def test_a_saved_section_that_is_invalid_is_named_as_damage_wherever_it_is_read(tmp_path):
    target = tiny_target()
    folder = build_drafter(Eagle3Config(ttt_steps=1), target).save_pretrained(tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    config["drafttrain"]["draft"]["ttt_steps"] = 0  # below its bound: no drafttrain wrote this
    (folder / "config.json").write_text(json.dumps(config))
    for read in (lambda: load_drafter(folder, target), lambda: SavedDraft.open(folder).max_depth(),
                 lambda: continued_config(SavedDraft.open(folder).section(), Eagle3Config(), str(folder))):
        with pytest.raises(DrafttrainError, match=r"config\.json.*holds an invalid eagle3 section"):
            read()
