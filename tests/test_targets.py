"""Target loading (built-in GGUF → cached safetensors, folders, GGUF files, errors) and hidden-state taps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.config import TargetConfig
from drafttrain.drafts.taps import low_mid_high_taps
from drafttrain.targets import HiddenStateTap, load_target, load_tokenizer
from drafttrain.targets.loading import builtin_gguf_path, resolve_model_dir


def test_builtin_target_is_converted_once_to_a_safetensors_folder(smollm2):
    folder = smollm2.source_dir
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer_config.json").is_file()
    assert not list(folder.glob("*.bin")), "safetensors only"
    assert resolve_model_dir("smollm2-135m-instruct") == str(folder)  # cached: no second conversion
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert not any(p.requires_grad for p in smollm2.model.parameters()) and not smollm2.model.training
    assert "<|im_start|>" in smollm2.tokenizer.chat_template


def test_processes_converting_the_builtin_target_at_once_share_one_conversion(smollm2, tmp_path):
    """Every process of a launch on a fresh machine loads the target at the same moment (the suite's first run
    on a fresh machine failed this way: one worker's temporary folder removed under another's write)."""
    convert = "from drafttrain.targets.loading import resolve_model_dir; print(resolve_model_dir('smollm2-135m-instruct'))"
    env = {**os.environ, "DRAFTTRAIN_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", convert], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    results = [proc.communicate(timeout=600) + (proc.returncode,) for proc in procs]
    assert [rc for _, _, rc in results] == [0, 0, 0], [err[-2000:] for _, err, _ in results]
    folders = {out.strip().splitlines()[-1] for out, _, _ in results}
    assert len(folders) == 1
    folder = tmp_path / "targets" / smollm2.source_dir.name
    assert folders == {str(folder)} and not list(tmp_path.glob("targets/*.tmp"))
    assert load_target(str(folder)).vocab_size == smollm2.vocab_size


def test_gguf_file_and_folder_specs_load_the_same_weights(smollm2):
    gguf = builtin_gguf_path("smollm2-135m-instruct")
    assert resolve_model_dir(str(gguf)) == str(smollm2.source_dir)
    again = load_target(TargetConfig(model=str(smollm2.source_dir)))
    a = smollm2.model.get_input_embeddings().weight
    assert torch.equal(a, again.model.get_input_embeddings().weight)


def test_missing_and_unknown_targets_say_how_to_get_them(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a Hub id answered from the cache alone
    with pytest.raises(DrafttrainError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "nope.gguf"))
    with pytest.raises(DrafttrainError, match="neither a model folder nor a .gguf file"):
        resolve_model_dir(str(tmp_path / "missing-folder"))
    with pytest.raises(DrafttrainError, match="built-in name"):
        resolve_model_dir("not-a-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DrafttrainError, match="holds no config.json: give a model's folder") as refused:
        load_target(str(empty))
    assert "huggingface-cli" not in str(refused.value)  # a local folder is never told to download itself
    with pytest.raises(DrafttrainError, match="huggingface-cli download"):  # a Hub id not on this machine is
        load_target("nobody-here/no-such-model")


def test_remote_code_stays_off_unless_asked(tmp_path, smollm2):
    folder = tmp_path / "custom"
    folder.mkdir()
    config = json.loads((smollm2.source_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(smollm2.source_dir / name)
    target = load_target(str(folder))  # trust_remote_code=False: the stock Llama class, the file never runs
    assert type(target.model).__name__ == "LlamaForCausalLM"


def test_chat_template_override_from_the_recipe(smollm2):
    tok = load_tokenizer(TargetConfig(chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_taps_equal_output_hidden_states(smollm2):
    ids = torch.tensor([[1, 2683, 359, 253, 5356]])
    layers = low_mid_high_taps(smollm2.num_layers) + [smollm2.num_layers]
    assert layers == [2, 15, 27, 30]
    with torch.no_grad(), HiddenStateTap(smollm2.model, layers) as tap:
        reference = smollm2.model(ids, output_hidden_states=True).hidden_states
    for index, got in zip(layers, tap.get()):
        assert torch.equal(got, reference[index]), index
    assert tap.stacked().shape == (1, 5, 4 * 576)


def test_a_tap_beyond_the_target_is_refused(smollm2):
    with pytest.raises(DrafttrainError, match="layer 31 does not exist.*30 layers"):
        HiddenStateTap(smollm2.model, [2, 31])


def test_device_auto_places_the_target_with_accelerate_and_computes_the_same(smollm2):
    """target.device: auto is device_map="auto" (on this CPU-only machine every layer lands on the CPU; spreading
    over GPUs is accelerate's, untested here); the forward is unchanged."""
    spread = load_target(TargetConfig(model="smollm2-135m-instruct", device="auto"))
    assert spread.device == torch.device("cpu")
    ids = torch.tensor([[1, 20, 300, 4000]])
    with torch.no_grad():
        torch.testing.assert_close(spread.model(ids).logits, smollm2.model(ids).logits)
