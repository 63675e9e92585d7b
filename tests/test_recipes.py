"""Every shipped recipe validates against the schema, and the local files it names exist."""

from pathlib import Path

import pytest
from conftest import REPO

from drafttrain import DrafttrainError
from drafttrain.config import load_recipe
from drafttrain.evaluation.checkpoint_eval import check_eval_shape

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_the_expected_recipes_ship():
    names = {p.name for p in RECIPES}
    assert {"smollm2_eagle3_quick.yaml", "smollm2_eagle3.yaml", "eagle3_llama3.1_8b.yaml", "eagle_llama70b.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates_and_its_local_files_exist(path, monkeypatch):
    monkeypatch.chdir(REPO)  # recipe paths are relative to the repository root
    recipe = load_recipe(path)
    # what `drafttrain train` checks before it starts (smollm2_dflash.yaml failed it: depth auto's default deepest
    # chain, 8, is more than a block of 8 can fill)
    check_eval_shape(recipe)
    if recipe.training.deepspeed:
        assert Path(recipe.training.deepspeed).is_file(), recipe.training.deepspeed
    for source in recipe.data.sources if recipe.data else []:
        if source.path.startswith(("data/", "./", "../", "/")):
            assert Path(source.path).is_file(), source.path


def test_cluster_recipes_are_set_for_gpus_and_zero():
    for name in ("eagle3_llama3.1_8b.yaml", "eagle_llama70b.yaml", "medusa2_llama3.1_8b.yaml", "dflash_llama3.1_8b.yaml",
                 "dflash_qwen3_8b.yaml", "mtp_qwen3_next_80b.yaml"):
        recipe = load_recipe(REPO / "recipes" / name)
        assert recipe.target.device == "cuda" and recipe.training.mixed_precision == "bf16"
        assert recipe.training.deepspeed


def test_unknown_key_and_wrong_type_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target:\n  model: smollm2-135m-instruct\n  dtyp: float32\ntraining:\n  epochs: many\n")
    with pytest.raises(DrafttrainError) as err:
        load_recipe(bad)
    assert "target.dtyp: unknown key" in str(err.value)
    assert "training.epochs" in str(err.value)


def test_overrides_keep_types_and_are_validated(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "smollm2_eagle3_quick.yaml", ["training.epochs=2", "draft.ttt_steps=3"])
    assert recipe.training.epochs == 2 and recipe.draft.ttt_steps == 3
    with pytest.raises(DrafttrainError, match="draft.ttt_steps"):
        load_recipe(REPO / "recipes" / "smollm2_eagle3_quick.yaml", ["draft.ttt_steps=0"])
    with pytest.raises(DrafttrainError, match="not of the form"):
        load_recipe(REPO / "recipes" / "smollm2_eagle3_quick.yaml", ["training.epochs"])


def test_mixed_precision_no_is_read_as_the_word_not_yaml_false():
    # YAML 1.1 reads `no` as false; the schema's message then asked for 'no', which the user had typed
    recipe = load_recipe(REPO / "recipes" / "smollm2_eagle3_quick.yaml", ["training.mixed_precision=no"])
    assert recipe.training.mixed_precision == "no"
    with pytest.raises(DrafttrainError, match="training.mixed_precision"):
        load_recipe(REPO / "recipes" / "smollm2_eagle3_quick.yaml", ["training.mixed_precision=true"])


def test_an_override_whose_value_is_not_yaml_is_named_not_a_traceback():
    from drafttrain.config import apply_overrides

    with pytest.raises(DrafttrainError, match=r"override 'training.max_steps=\[1': the value is not valid YAML"):
        apply_overrides({}, ["training.max_steps=[1"])
