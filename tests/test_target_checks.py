"""A target that cannot load is one line naming its file, from every command that loads one (prepare, train, eval,
export, plan, import: exit 2, no traceback), and a local one is never told to download it; a draft given another target
than the one it was trained for is told which facts differ, never that it is damaged.

The damaged targets are tiny random models (tests/families.py) saved to a temporary folder and then damaged: a
truncated or corrupt model.safetensors, no weights, a config.json whose layer_types disagree with
num_hidden_layers, a T5 and a Llava config as transformers saves them, a config needing its own code, and the
built-in GGUF cut in its tensor data or in its header."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, small_recipe
from families import family_model

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.targets import load_target, load_tokenizer
from drafttrain.targets.loading import builtin_gguf_path, target_config

FOREIGN = REPO / "tests" / "fixtures" / "speculators_eagle3" / "full_vocab"
COMMANDS = ("prepare", "train", "eval", "export", "plan", "import")


def refusal(capsys, *argv) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith(f"drafttrain {argv[0]}: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def saved_model(folder: Path, family: str = "llama", **changes) -> Path:
    family_model(family, **changes).save_pretrained(folder)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return folder


def edited_config(folder: Path, edit) -> Path:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny llama target folder and an EAGLE-3 run prepared and trained on it (a folder with good/, run/ and
    recipe.yaml)."""
    root = tmp_path_factory.mktemp("checks")
    good = saved_model(root / "good")
    small_recipe(root, {"kind": "eagle3", "ttt_steps": 1, "intermediate_size": 32}, target={"model": str(good)},
                 training={"max_steps": 1, "save_every": 1}, eval={"every_checkpoint": False})
    assert main(["prepare", str(root / "recipe.yaml"), "--no-progress"]) == 0
    assert main(["train", str(root / "recipe.yaml")]) == 0
    return root


def _copy(run: Path, name: str) -> Path:
    return Path(shutil.copytree(run / "good", run / name, dirs_exist_ok=True))


def _truncated(run: Path) -> Path:
    weights = _copy(run, "truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return weights.parent


def _corrupt(run: Path) -> Path:
    weights = _copy(run, "corrupt") / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[12:40] = b"\xff" * 28  # inside the JSON header
    weights.write_bytes(bytes(data))
    return weights.parent


def _no_weights(run: Path) -> Path:
    folder = _copy(run, "no-weights")
    (folder / "model.safetensors").unlink()
    return folder


def _layer_types(run: Path) -> Path:
    folder = saved_model(run / "layer-types", "gemma3")
    return edited_config(folder, lambda config: config.update(layer_types=config["layer_types"][:3]))


def _t5(run: Path) -> Path:
    from transformers import T5Config

    T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2).save_pretrained(run / "t5")
    return run / "t5"


def _llava(run: Path) -> Path:
    from transformers import LlavaConfig

    text = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 49152}
    vision = {"model_type": "clip_vision_model", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32, "image_size": 32, "patch_size": 8}
    LlavaConfig(text_config=text, vision_config=vision).save_pretrained(run / "llava")
    return run / "llava"


def _remote_code(run: Path) -> Path:
    code = {"AutoConfig": "configuration_mine.MineConfig", "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    return edited_config(_copy(run, "remote"), lambda config: config.update(model_type="minenet", auto_map=code))


def _gguf_cut(run: Path, keep: int | None = None) -> Path:
    data = builtin_gguf_path("smollm2-135m-instruct").read_bytes()
    path = run / f"cut-{keep or 'half'}.gguf"
    path.write_bytes(data[: keep or len(data) // 2])
    return path


# case -> (how it is made, what the one line says)
CASES = {
    "truncated safetensors": (_truncated, r"truncated/model.safetensors is truncated: [\d,]+ bytes of the [\d,]+ its "
                                          "header describes"),
    "corrupt safetensors": (_corrupt, "corrupt/model.safetensors is damaged: its header is not a safetensors header"),
    "no weights": (_no_weights, "no-weights holds no weights"),
    "layer_types": (_layer_types, r"layer-types/config.json contradicts itself .*`num_hidden_layers` \(4\) must be "
                                  r"equal to the number of `layer_types` \(3\)"),
    "t5": (_t5, r"is an encoder-decoder model \(t5\): drafttrain drafts for decoder-only causal LMs"),
    "llava": (_llava, r"is a multimodal model \(llava, with vision_config\).* text tower is not supported as a "
                      "target yet"),
    "remote code": (_remote_code, "needs its own modelling code .*modeling_mine.MineForCausalLM.*"
                                  "target.trust_remote_code: true"),
    "gguf cut in its data": (_gguf_cut, r"cut-half.gguf is truncated: [\d,]+ bytes of the [\d,]+ its header "
                                        "describes"),
    "gguf cut in its header": (lambda run: _gguf_cut(run, 5000), r"cut-5000.gguf is truncated: it ends inside its "
                                                                  r"header \(5,000 bytes\)"),
}


def command(name: str, run: Path, target: Path, out: Path) -> list:
    return {"prepare": ["prepare", run / "recipe.yaml", f"target.model={target}", f"output_dir={out}", "--no-progress"],
            "train": ["train", run / "recipe.yaml", f"target.model={target}"],
            "plan": ["plan", run / "recipe.yaml", f"target.model={target}"],
            "eval": ["eval", "--target", target, "--proposer", "prompt_lookup", "--num-prompts", "1", "--out", out],
            "export": ["export", run / "run", "--format", "vllm", "--target", target, "--out", out],
            "import": ["import", FOREIGN, "--target", target, "--out", out]}[name]


# a plan, and a prepare that regenerates nothing, read the config and tokenizer alone: a folder without weights
# plans and prepares (test_a_plan_needs_no_weights_but_refuses_damaged_ones)
EVERY = [(case, name) for case in CASES for name in COMMANDS
         if not (case == "no weights" and name in ("plan", "prepare"))]


@pytest.mark.parametrize("case, name", EVERY)
def test_every_target_problem_is_one_line_naming_its_file_from_every_command(run, capsys, tmp_path, case, name):
    """Today's tracebacks: SafetensorError, StrictDataclassClassValidationError, "Unrecognized configuration class",
    the custom-code ValueError, the GGUF reader's reshape and struct errors; a folder without weights was told to
    download it from the Hub."""
    make, said = CASES[case]
    target = make(run)
    line = refusal(capsys, *command(name, run, target, tmp_path / "out"))
    assert re.search(said, line), line
    assert "huggingface-cli" not in line and "hf.co" not in line and "huggingface.co" not in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_plan_needs_no_weights_but_refuses_damaged_ones(run, capsys):
    """`plan` reads config files: a folder holding config.json alone plans, a truncated weights file does not."""
    capsys.readouterr()
    assert main(["plan", str(run / "recipe.yaml"), f"target.model={_no_weights(run)}"]) in (0, 1)
    line = refusal(capsys, "plan", run / "recipe.yaml", f"target.model={_truncated(run)}")
    assert "model.safetensors is truncated" in line


def test_the_checks_pass_every_sound_file_they_read(run):
    from drafttrain.targets.checks import gguf_problem, safetensors_problem

    assert safetensors_problem(run / "good" / "model.safetensors") is None
    assert gguf_problem(builtin_gguf_path("smollm2-135m-instruct")) is None
    assert load_target(str(run / "good")).num_layers == 4


def test_a_local_folder_is_never_told_to_download_it(run, monkeypatch):
    """A folder lacking its tokenizer was told "huggingface-cli download ORG/NAME" like a Hub id offline (or raised
    a ValueError), and so was a missing good/missing, a path whose first folder is here."""
    folder = _copy(run, "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(DrafttrainError) as refused:
        load_tokenizer(str(folder))
    assert "huggingface-cli" not in str(refused.value) and "model.safetensors" in str(refused.value)
    monkeypatch.chdir(run)
    with pytest.raises(DrafttrainError, match="'good/missing' is neither a model folder nor a .gguf file"):
        load_target("good/missing")


def test_trusted_remote_code_that_is_missing_is_named_without_the_hub(run, capsys):
    line = refusal(capsys, "plan", run / "recipe.yaml", f"target.model={_remote_code(run)}",
                   "target.trust_remote_code=true")
    assert "configuration_mine.py" in line and "huggingface.co" not in line, line


@pytest.mark.parametrize("adapter", ["lora/nope", "nope", "lora/empty"])
def test_a_missing_adapter_is_named_whatever_its_path_spelling(capsys, tmp_path, monkeypatch, adapter):
    """MODEL+lora/nope (a relative path without ./) was read as a Hub repo id and sent to the Hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lora" / "empty").mkdir(parents=True)
    why = "has no adapter_config.json" if adapter == "lora/empty" else "does not exist"
    with pytest.raises(DrafttrainError, match=f"the adapter folder {adapter} {why}"):
        target_config(f"smollm2-135m-instruct+{adapter}")
    line = refusal(capsys, "eval", "--target", f"smollm2-135m-instruct+{adapter}", "--proposer", "prompt_lookup",
                   "--out", tmp_path / "out")
    assert f"the adapter folder {adapter} {why}" in line and "huggingface-cli" not in line, line


# ------------------------------------------------------------------------------------- a draft for another target


def _other_rope(run: Path) -> Path:
    return edited_config(_copy(run, "other-rope"), lambda config: config["rope_parameters"].update(rope_theta=1e6))


def test_a_draft_given_another_target_is_told_which_not_that_it_is_damaged(run, capsys, tmp_path):
    """A head evaluated on a target of the same sizes but another RoPE was "damaged: ... delete step-000001"."""
    other = _other_rope(run)
    for argv in (["eval", "--target", other, "--draft", run / "run", "--num-prompts", "1", "--out", tmp_path / "e"],
                 ["export", run / "run", "--format", "vllm", "--target", other, "--out", tmp_path / "x"]):
        line = refusal(capsys, *argv)
        assert f"was trained for target '{run / 'good'}', given '{other}'" in line, line
        assert "rope_parameters.rope_theta 10000.0 trained for, 1000000.0 given" in line, line
        assert "delete" not in line and "damaged" not in line and "resume" not in line, line
    heads = saved_model(run / "other-heads", num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    line = refusal(capsys, "eval", "--target", heads, "--draft", run / "run", "--num-prompts", "1", "--out",
                   tmp_path / "h")
    assert "num_attention_heads 4 trained for, 8 given" in line and "head_dim 16 trained for, 8 given" in line, line
    capsys.readouterr()
    assert main(["export", str(run / "run"), "--format", "vllm", "--out", str(tmp_path / "ok")]) == 0


def test_medusa_heads_compare_the_model_and_its_sizes_not_its_rope(run, tmp_path):
    """Heads on the final hidden state mirror no attention of the target's: another RoPE (a long-context fine-tune's)
    serves them; another size does not."""
    from drafttrain.config import MedusaConfig
    from drafttrain.drafts import build_drafter, load_drafter

    build_drafter(MedusaConfig(num_heads=2), load_target(str(run / "good"))).save_pretrained(tmp_path / "medusa")
    assert load_drafter(tmp_path / "medusa", load_target(str(_other_rope(run)))).kind == "medusa"
    deeper = saved_model(run / "deeper", num_hidden_layers=6)
    with pytest.raises(DrafttrainError, match="num_hidden_layers 4 trained for, 6 given"):
        load_drafter(tmp_path / "medusa", load_target(str(deeper)))


def _as_before_the_fingerprint(run: Path, to: Path) -> Path:
    """The run's draft as drafttrain saved it before it recorded more of its target than these seven facts."""
    checkpoint = run / "run" / "checkpoints" / "step-000001"
    to.mkdir()
    shutil.copy(checkpoint / "model.safetensors", to / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    old = ("name", "vocab_size", "hidden_size", "num_hidden_layers", "model_type", "architectures", "tokenizer")
    config["drafttrain"]["target"] = {key: config["drafttrain"]["target"][key] for key in old}
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_a_draft_saved_before_the_fingerprint_loads_and_is_compared_on_what_it_records(run, capsys, tmp_path):
    from drafttrain.drafts import load_drafter

    old = _as_before_the_fingerprint(run, tmp_path / "old")
    assert load_drafter(old, load_target(str(run / "good"))).kind == "eagle3"
    narrow = saved_model(run / "narrow", hidden_size=32, head_dim=8)
    line = refusal(capsys, "eval", "--target", narrow, "--draft", old, "--num-prompts", "1", "--out", tmp_path / "n")
    assert "hidden_size 64 trained for, 32 given" in line and "delete" not in line, line
    # RoPE is not in its record: config.json's own copy says it, and the message says both causes, deleting nothing
    line = refusal(capsys, "eval", "--target", _other_rope(run), "--draft", old, "--num-prompts", "1", "--out",
                   tmp_path / "r")
    assert "it was trained for another target" in line and "or the file was edited" in line, line
    assert "delete" not in line, line

