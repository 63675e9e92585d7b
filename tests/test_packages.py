"""Every package the product uses is installed by `pip install -e .`; a recipe that needs one that is missing is
refused before any work starts, with the package, the recipe field and the install command named."""

import re
import sys
import tomllib

import pytest
from conftest import REPO

from drafttrain.commands import main
from drafttrain.config import load_recipe, needed_packages, parse_recipe
from drafttrain.packages import install_command, installed

# what the product imports at some point of its pipeline (README: torch, transformers, accelerate, deepspeed,
# datasets, wandb, peft, safetensors, huggingface_hub, gguf)
PRODUCT_PACKAGES = ["torch", "transformers", "accelerate", "deepspeed", "datasets", "wandb", "peft", "safetensors",
                    "huggingface_hub", "gguf"]


def dependency_names() -> set[str]:
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[ ]", s, maxsplit=1)[0].lower().replace("-", "_") for s in spec}


def test_every_package_the_product_uses_is_a_plain_dependency():
    names = dependency_names()
    assert [p for p in PRODUCT_PACKAGES if p not in names] == []
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) == {"dev"}  # test tools (and a test target) only


def test_the_install_command_carries_our_own_pin():
    assert install_command("wandb") == "pip install 'wandb>=0.17'"
    pins = {re.split(r"[<>=!~\[ ]", s, maxsplit=1)[0]: s.split("#")[0].strip() for s in
            tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert install_command("peft") == f"pip install '{pins['peft']}'"  # floor and ceiling, as pyproject writes them
    assert "<" in pins["peft"] and install_command("transformers") == f"pip install '{pins['transformers']}'"


def _absent(monkeypatch, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` and find_spec both see it missing
    assert not installed(module)


def test_what_a_recipe_needs_is_read_from_its_sections(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recipe = parse_recipe({"target": {"adapter": "x"}, "training": {"deepspeed": "z.json"},
                           "draft": {"kind": "medusa", "target_lora": {"target_modules": ["q_proj"]}}})
    assert sorted(needed_packages(recipe)) == [("draft.target_lora", "peft"), ("target.adapter", "peft"),
                                               ("training.deepspeed", "deepspeed"), ("wandb.mode", "wandb")]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert ("wandb.mode", "wandb") not in needed_packages(recipe)


@pytest.mark.parametrize("recipe, module, field", [
    ("recipes/smollm2_eagle3_quick.yaml", "wandb", "wandb.mode"),
    ("recipes/smollm2_medusa2.yaml", "peft", "draft.target_lora"),
])
def test_a_recipe_whose_package_is_missing_is_refused_before_prepare(recipe, module, field, monkeypatch, tmp_path,
                                                                     capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(REPO)
    _absent(monkeypatch, module)
    out = tmp_path / "run"
    assert main(["prepare", recipe, f"output_dir={out}"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0  # one line, no traceback
    assert f"{field} in {recipe} needs the package {module}, which is not installed: pip install '{module}>=" in error
    assert not out.exists()  # nothing was started


def test_a_recipe_with_its_packages_present_loads(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert load_recipe(REPO / "recipes/smollm2_medusa2.yaml").draft.target_lora is not None
