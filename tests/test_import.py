"""``drafttrain import``: drafts speculators' own classes wrote (tests/fixtures/speculators_dflash and
speculators_eagle3, made by their make.py) become drafttrain checkpoints that hold every weight as written, decode losslessly, and export back to the
same tensors; what does not fit the target is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_draft_model import tiny_target

from drafttrain import DrafttrainError
from drafttrain.config import Eagle3Config, EagleConfig
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.drafts import load_drafter, start_drafter
from drafttrain.export import export_draft
from drafttrain.export.importer import import_draft

FIXTURES = Path(__file__).parent / "fixtures" / "speculators_dflash"
EAGLE3 = Path(__file__).parent / "fixtures" / "speculators_eagle3"
SPECFORGE = Path(__file__).parent / "fixtures" / "specforge_eagle3"
EAGLE1 = Path(__file__).parent / "fixtures" / "eagle1"
VLLM_MEDUSA = Path(__file__).parent / "fixtures" / "vllm_medusa"
PEAGLE = Path(__file__).parent / "fixtures" / "speculators_peagle"
FOREIGN_EXTRAS = ("embed_tokens.weight",)  # the target's embeddings, which speculators' files carry a copy of


def written(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "model.safetensors"))


@pytest.mark.parametrize("name, attention, layers, block", [("draft_vocab", "causal", 2, 4),
                                                            ("full_vocab", "bidirectional", 1, 5)])
def test_a_speculators_dflash_draft_imports_with_every_weight_and_exports_back(tmp_path, name, attention, layers,
                                                                               block):
    target = tiny_target()
    out, notes = import_draft(FIXTURES / name, target, tmp_path / "imported")
    drafter = load_drafter(out, target)
    assert (drafter.config.block_attention, drafter.config.num_layers, drafter.block_size) == (attention, layers, block)
    assert drafter.layer_ids == [1, 2, 3] and drafter.mask_token_id == 63 and notes == []
    mine = drafter.state_tensors()
    for key, value in written(name).items():
        assert torch.equal(mine[key], value), key
    if name == "full_vocab":  # speculators leaves the whole-vocabulary head out: it is the target's own
        assert torch.equal(mine["lm_head.weight"], target.model.get_output_embeddings().weight)
    config = json.loads((out / "config.json").read_text())
    assert config["drafttrain"]["imported"]["format"] == "speculators"
    export = export_draft(out, "speculators", tmp_path / "export", target)
    theirs, back = json.loads((FIXTURES / name / "config.json").read_text()), json.loads((export / "config.json").read_text())
    for key in ("block_size", "aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size",
                "sliding_window_non_causal", "sample_from_anchor"):
        assert back[key] == theirs[key], key
    exported = load_file(str(export / "model.safetensors"))
    for key, value in written(name).items():
        assert torch.equal(exported[key], value), key


def test_an_imported_draft_decodes_the_targets_greedy_output(tmp_path):
    target = tiny_target()
    drafter = load_drafter(import_draft(FIXTURES / "draft_vocab", target, tmp_path / "imported")[0], target).eval()
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer("block", target, draft=drafter), depth=3)
    assert decoder.generate(prompt, 24).tokens == plain_decode(target, prompt, 24).tokens


def test_a_draft_for_another_target_is_refused_naming_the_size(tmp_path):
    with pytest.raises(DrafttrainError, match="hidden_size is 32, the target 'tiny' has 16"):
        import_draft(FIXTURES / "draft_vocab", tiny_target_of(hidden=16), tmp_path / "imported")
    with pytest.raises(DrafttrainError, match="rope_theta"):
        import_draft(FIXTURES / "draft_vocab", tiny_target_of(rope_theta=5e5), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_what_is_not_a_foreign_draft_is_refused(tmp_path):
    target = tiny_target()
    out, _ = import_draft(FIXTURES / "full_vocab", target, tmp_path / "imported")
    with pytest.raises(DrafttrainError, match="written by drafttrain"):
        import_draft(out, target, tmp_path / "again")
    other = tmp_path / "other"
    shutil.copytree(FIXTURES / "full_vocab", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "speculators_model_type": "mtp"}))
    with pytest.raises(DrafttrainError, match="not a draft format drafttrain imports"):
        import_draft(other, target, tmp_path / "mtp")
    (other / "config.json").write_text(json.dumps({**config, "mask_token_id": None}))
    with pytest.raises(DrafttrainError, match="names no mask_token_id"):
        import_draft(other, target, tmp_path / "no-mask")
    with pytest.raises(DrafttrainError, match="not empty"):
        import_draft(FIXTURES / "full_vocab", target, out)


@pytest.mark.parametrize("name, taps, eagle31, vocab", [("eagle31_draft_vocab", [1, 2, 3], True, 16),
                                                        ("full_vocab", [0, 2, 3], False, 64)])
def test_a_speculators_eagle3_draft_imports_with_every_weight_and_exports_back(tmp_path, name, taps, eagle31, vocab):
    target = tiny_target()
    out, notes = import_draft(EAGLE3 / name, target, tmp_path / "imported")
    drafter = load_drafter(out, target)
    assert drafter.kind == "eagle3" and drafter.layer_ids == taps and notes == []
    assert (drafter.config.fc_norm, drafter.config.norm_output, drafter.d2t.numel()) == (eagle31, eagle31, vocab)
    theirs = load_file(str(EAGLE3 / name / "model.safetensors"))
    mine = drafter.state_tensors()
    for key, value in theirs.items():
        if key not in FOREIGN_EXTRAS:
            assert torch.equal(mine[key.replace("layers.0.", "midlayer.")], value), key
    export = export_draft(out, "speculators", tmp_path / "export", target)
    config, back = json.loads((EAGLE3 / name / "config.json").read_text()), json.loads((export / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "fc_norm", "norm_output", "target_hidden_size"):
        assert back[key] == config[key], key
    speculative = [c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] for c in (back, config)]
    assert speculative[0] == speculative[1] == 3  # the draft length engines default to, kept
    exported = load_file(str(export / "model.safetensors"))
    assert exported.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(exported[key], value) or key in FOREIGN_EXTRAS, key


def peagle_trained_for(target, tmp_path: Path, name: str = "llama_layers") -> Path:
    """speculators' P-EAGLE fixture with the target's embedding table written in, as speculators' trainer copies the
    verifier's (the fixture's random table stands for another verifier's); its mask token's row kept as written."""
    folder = tmp_path / name
    shutil.copytree(PEAGLE / name, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    table = target.model.get_input_embeddings().weight.detach().clone()
    table[63] = tensors["embed_tokens.weight"][63]
    save_file({**tensors, "embed_tokens.weight": table.contiguous()}, str(folder / "model.safetensors"))
    return folder


def test_a_speculators_p_eagle_draft_imports_with_every_weight_decodes_losslessly_and_exports_back(tmp_path):
    target = tiny_target()
    source = peagle_trained_for(target, tmp_path)
    out, _ = import_draft(source, target, tmp_path / "imported")
    drafter = load_drafter(out, target).eval()
    assert type(drafter).__name__ == "PEagleDrafter" and drafter.config.parallel.depths == 4 and drafter.mask_token_id == 63
    assert drafter.layer_ids == [1, 2, 3] and drafter.d2t.numel() == 16
    theirs, mine = load_file(str(source / "model.safetensors")), drafter.state_tensors()
    assert torch.equal(mine["mask_embedding"], theirs["embed_tokens.weight"][63])
    for key, value in theirs.items():
        if key not in FOREIGN_EXTRAS:
            assert torch.equal(mine[key.replace("layers.0.", "midlayer.")], value), key
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer(drafter.proposer, target, draft=drafter), depth=4)
    assert decoder.generate(prompt, 24).tokens == plain_decode(target, prompt, 24).tokens
    export = export_draft(out, "speculators", tmp_path / "export", target)
    back = json.loads((export / "config.json").read_text())
    assert back["speculators_model_type"] == "peagle" and back["mask_token_id"] == 63
    assert back["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    exported = load_file(str(export / "model.safetensors"))
    for key, value in theirs.items():
        assert torch.equal(exported[key], value), key


def test_p_eagle_drafts_that_compute_something_else_are_refused_naming_why(tmp_path):
    """speculators' P-EAGLE defaults: Qwen3 layers (q and k normed) and a trained embedding table. drafttrain's head
    computes neither, so importing would serve another draft than the one trained."""
    target = tiny_target()
    with pytest.raises(DrafttrainError, match="normalise q and k"):
        import_draft(peagle_trained_for(target, tmp_path, "qwen3_layers"), target, tmp_path / "qwen3")
    with pytest.raises(DrafttrainError, match="embed_requires_grad"):  # the fixture's own table: not the target's
        import_draft(PEAGLE / "llama_layers", target, tmp_path / "trained-table")


def test_an_imported_eagle3_draft_serves_losslessly_and_continues_as_saved(tmp_path):
    target = tiny_target()
    out, _ = import_draft(EAGLE3 / "eagle31_draft_vocab", target, tmp_path / "imported")
    drafter = load_drafter(out, target).eval()
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer(drafter.proposer, target, draft=drafter), depth=3)
    assert decoder.generate(prompt, 24).tokens == plain_decode(target, prompt, 24).tokens
    continued = start_drafter(Eagle3Config(init_from=str(out), step_decay=0.5), target)  # adapt a published head
    assert continued.config.fc_norm and continued.config.layers == [1, 2, 3] and continued.config.ttt_steps == 3
    assert continued.config.step_decay == 0.5
    assert all(torch.equal(a, b) for a, b in zip(continued.state_tensors().values(), drafter.state_tensors().values()))


@pytest.mark.parametrize("name, layers, taps, fc_norm, vocab", [("draft_vocab", 8, [2, 4, 5], False, 16),
                                                               ("eagle31", 4, [1, 2, 3], True, 64)])
def test_a_specforge_eagle3_draft_imports_with_every_weight(tmp_path, name, layers, taps, fc_norm, vocab):
    # draft_vocab leaves its taps to the default (2, L/2, L-3 as inputs: an 8-layer target); eagle31 names them in
    # SpecForge's (SGLang's) numbering, the output of layers 0-2
    target = tiny_target(layers=layers)
    out, _ = import_draft(SPECFORGE / name, target, tmp_path / "imported")
    drafter = load_drafter(out, target).eval()
    assert drafter.layer_ids == taps and drafter.config.fc_norm == fc_norm and not drafter.config.norm_output
    assert drafter.d2t.numel() == vocab
    mine = drafter.state_tensors()
    for key, value in load_file(str(SPECFORGE / name / "model.safetensors")).items():
        if key not in FOREIGN_EXTRAS:
            assert torch.equal(mine[key], value), key
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer(drafter.proposer, target, draft=drafter), depth=3)
    assert decoder.generate(prompt, 16).tokens == plain_decode(target, prompt, 16).tokens


def refused_when_changed(folder: Path, changes, target, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of ``folder``, imported once per (config change, reason): each must be refused with that reason.
    Returns the copy and its original config."""
    other = tmp_path / f"changed-{folder.name}"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    for change, reason in changes:
        (other / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(DrafttrainError, match=reason):
            import_draft(other, target, tmp_path / "imported")
    return other, config


def test_an_eagle3_draft_with_a_norm_drafttrain_does_not_compute_is_refused(tmp_path):
    other, config = refused_when_changed(
        EAGLE3 / "full_vocab", [({"norm_before_fc": True}, "sets norm_before_fc"),
                                ({"embed_requires_grad": True}, "sets embed_requires_grad"),
                                ({"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}, r"aux layer ids \[0, 2, 9\] must be")],
        tiny_target(), tmp_path)
    layer = config["transformer_layer_config"]
    for types, window, problem in ((["sliding_attention"], None, "name no sliding_window"),
                                   (["sliding_attention", "full_attention"], 16, "mixes layer types")):
        mixed = {**layer, "num_hidden_layers": len(types), "layer_types": types, "sliding_window": window}
        (other / "config.json").write_text(json.dumps({**config, "transformer_layer_config": mixed}))
        with pytest.raises(DrafttrainError, match=problem):
            import_draft(other, tiny_target(), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def target_with_embedding_of(folder: Path):
    """The tiny target, given the embedding the EAGLE-1 head was trained with (EAGLE copies its target's)."""
    target = tiny_target()
    with torch.no_grad():
        target.model.get_input_embeddings().weight.copy_(load_file(str(folder / "model.safetensors"))["embed_tokens.weight"])
    return target


@pytest.mark.parametrize("name, layers, fc_bias", [("vicuna", 1, True), ("llama3", 2, False)])
def test_an_eagle1_head_from_eagles_trainer_imports_and_computes_what_eagle_computes(tmp_path, name, layers, fc_bias):
    target = target_with_embedding_of(EAGLE1 / name)
    out, notes = import_draft(EAGLE1 / name, target, tmp_path / "imported")
    assert (notes == []) == fc_bias
    drafter = load_drafter(out, target).eval()
    assert drafter.kind == "eagle" and drafter.config.num_layers == layers
    mine, theirs = drafter.state_tensors(), load_file(str(EAGLE1 / name / "model.safetensors"))
    for key, value in theirs.items():
        if key != "embed_tokens.weight":  # the target's own, which the head reads
            assert torch.equal(mine[key], value), key
    assert fc_bias or not mine["fc.bias"].any()
    reference = load_file(str(EAGLE1 / name / "reference.safetensors"))  # EAGLE's own forward on this input
    with torch.no_grad():
        hidden, _ = drafter.step(reference["hidden"], reference["input_ids"], torch.arange(6)[None],
                                 drafter.new_caches())
    assert torch.allclose(hidden, reference["output"], atol=1e-5, rtol=1e-4)
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer(drafter.proposer, target, draft=drafter), depth=3)
    assert decoder.generate(prompt, 24).tokens == plain_decode(target, prompt, 24).tokens
    for fmt in ("vllm", "sglang"):
        served = load_drafter(export_draft(out, fmt, tmp_path / fmt, target), target)
        assert all(torch.allclose(served.state_tensors()[k], v) for k, v in mine.items()), fmt
    continued = start_drafter(EagleConfig(init_from=str(out), noise=0.1), target)
    assert continued.config.num_layers == layers and continued.config.noise == 0.1


def test_an_eagle1_head_for_another_target_or_with_what_drafttrain_does_not_compute_is_refused(tmp_path):
    with pytest.raises(DrafttrainError, match="embed_tokens is not this target's embedding"):
        import_draft(EAGLE1 / "vicuna", tiny_target(), tmp_path / "imported")
    pickled = tmp_path / "pickled"  # as EAGLE-1's published heads are: refused, never unpickled
    pickled.mkdir()
    shutil.copy(EAGLE1 / "vicuna" / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(DrafttrainError, match="pytorch_model.bin, a pickle"):
        import_draft(pickled, tiny_target(), tmp_path / "imported")
    target = target_with_embedding_of(EAGLE1 / "vicuna")
    other, config = refused_when_changed(
        EAGLE1 / "vicuna", [({"qkv_bias": True}, "sets qkv_bias"),
                            ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "sets rope_scaling"),
                            ({"bias": False}, "config says bias False but the weights hold fc.bias"),
                            ({"vocab_size": 128}, "vocab_size is 128, the target 'tiny' has 64")],
        target, tmp_path)
    with pytest.raises(DrafttrainError, match=r"its fc.weight is \(32, 64\), EAGLE-1's is \(16, 32\)"):
        import_draft(EAGLE1 / "vicuna", tiny_target_of(hidden=16), tmp_path / "imported")
    (other / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 32}))  # EAGLE's EAGLE-3 trainer's
    with pytest.raises(DrafttrainError, match="is not a draft format drafttrain imports"):
        import_draft(other, target, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("name, heads, layers, vocab", [("plain", 3, 1, 64), ("fasterdecoding", 2, 2, 64),
                                                      ("token_map", 2, 1, 16)])
def test_medusa_heads_in_vllms_layout_import_and_compute_what_vllm_computes(tmp_path, name, heads, layers, vocab):
    target = tiny_target()
    out, notes = import_draft(VLLM_MEDUSA / name, target, tmp_path / "imported")
    assert (notes == []) == (name == "fasterdecoding")  # the others' blocks have no bias in vLLM: ours are zero
    drafter = load_drafter(out, target).eval()
    assert (drafter.kind, drafter.config.num_heads, drafter.config.num_layers) == ("medusa", heads, layers)
    assert drafter.d2t.numel() == vocab
    reference = load_file(str(VLLM_MEDUSA / name / "reference.safetensors"))  # vLLM's Medusa, loaded by vLLM
    with torch.no_grad():
        logits = drafter.head_logits(reference["hidden"])
    for h in range(heads):
        assert torch.equal(logits[:, h].isinf(), reference[f"logits.{h}"].isinf())
        assert torch.allclose(logits[:, h], reference[f"logits.{h}"], atol=1e-5, rtol=1e-4), h
    prompt = [5, 9, 17, 3]
    decoder = SpeculativeDecoder(target, build_proposer("medusa", target, draft=drafter), depth=2)
    assert decoder.generate(prompt, 24).tokens == plain_decode(target, prompt, 24).tokens
    if name == "token_map":  # vLLM also reads the shared head under the name lm_head.weight
        renamed = tmp_path / "renamed"
        shutil.copytree(VLLM_MEDUSA / name, renamed)
        tensors = load_file(str(renamed / "model.safetensors"))
        tensors["lm_head.weight"] = tensors.pop("medusa_heads.lm_heads.0.weight")
        save_file(tensors, str(renamed / "model.safetensors"))
        again = load_drafter(import_draft(renamed, target, tmp_path / "again")[0], target)
        assert all(torch.equal(again.state_tensors()[k], v) for k, v in drafter.state_tensors().items())
    if vocab == 64:  # vLLM 0.32 serves Medusa heads over the whole vocabulary only
        back = load_drafter(export_draft(out, "vllm", tmp_path / "export", target), target)
        assert all(torch.equal(back.state_tensors()[k], v) for k, v in drafter.state_tensors().items())


def test_medusa_heads_vllm_would_load_otherwise_or_for_another_target_are_refused(tmp_path):
    with pytest.raises(DrafttrainError, match="hidden_size is 32, the target 'tiny' has 16"):
        import_draft(VLLM_MEDUSA / "plain", tiny_target_of(hidden=16), tmp_path / "imported")
    refused_when_changed(
        VLLM_MEDUSA / "fasterdecoding",
        [({"medusa_fc_bias": False}, "vLLM would not load with this config.*set medusa_fc_bias true"),
         ({"truncated_vocab_size": 16}, "truncated_vocab_size is 16, but the heads hold no token_map"),
         ({"logit_scale": 0.5}, "logit_scale 0.5")], tiny_target(), tmp_path)
    # a token_map with a lm_head per head: vLLM 0.32 cannot load it
    mapped, _ = refused_when_changed(VLLM_MEDUSA / "token_map",
                                     [({"original_lm_head": False}, "a token_map but one lm_head each")],
                                     tiny_target(), tmp_path)
    (mapped / "model.safetensors").rename(mapped / "medusa_lm_head.safetensors")  # as FasterDecoding names it
    with pytest.raises(DrafttrainError, match="as medusa_lm_head.safetensors: name the file model.safetensors"):
        import_draft(mapped, tiny_target(), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def tiny_target_of(hidden: int = 32, rope_theta: float = 10000.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.targets.loading import Target

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    return Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), None)


@pytest.mark.parametrize("change, reason", [
    ("past", "outside the target's vocabulary of 64"),
    ("inverse", "t2d is not the inverse of d2t"),
    ("twice", "two draft ids to the same target id"),
])
def test_an_eagle3_draft_whose_vocabulary_maps_are_wrong_is_refused_at_import_and_at_load(tmp_path, change, reason):
    """The values are checked, not only the shapes: a d2t mapping past the target's vocabulary (eval then died in
    an IndexError), a t2d that disagrees with d2t, or two draft ids on one target id would train and draft wrong
    tokens with exit 0. Refused at import, and at every load of a checkpoint changed afterwards."""
    from safetensors.torch import save_file

    target = tiny_target()
    other = tmp_path / "changed"
    shutil.copytree(EAGLE3 / "eagle31_draft_vocab", other)
    tensors = load_file(str(other / "model.safetensors"))
    d2t, t2d = tensors["d2t"].clone(), tensors["t2d"].clone()
    if change == "past":
        d2t[-1] += 64
    elif change == "inverse":
        t2d[int(torch.nonzero(~t2d)[0])] = True
        t2d[int(torch.nonzero(t2d)[-1])] = False
    else:
        d2t[1] = d2t[0] - 1  # draft id 1 names draft id 0's target id
    save_file({**tensors, "d2t": d2t, "t2d": t2d}, str(other / "model.safetensors"))
    with pytest.raises(DrafttrainError, match=reason):
        import_draft(other, target, tmp_path / "imported")
    good, _ = import_draft(EAGLE3 / "eagle31_draft_vocab", target, tmp_path / "good")
    saved = load_file(str(good / "model.safetensors"))
    save_file({**saved, "d2t": d2t, "t2d": t2d}, str(good / "model.safetensors"))
    (good / "manifest.json").unlink(missing_ok=True)  # an edit the manifest would catch first; the maps must too
    with pytest.raises(DrafttrainError, match=reason):
        load_drafter(good, target)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_integer_weights_where_the_draft_has_float_ones_are_refused_naming_the_tensor(tmp_path, dtype):
    """An int32 fc.weight was cast into the float weights without a word: the draft computed with its integers."""
    other = tmp_path / "integer"
    shutil.copytree(EAGLE3 / "full_vocab", other)
    tensors = load_file(str(other / "model.safetensors"))
    save_file({**tensors, "fc.weight": tensors["fc.weight"].round().to(dtype)}, str(other / "model.safetensors"))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(DrafttrainError, match=f"holds fc.weight \\({name}\\) where the draft's weights are floating"):
        import_draft(other, tiny_target(), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


FOREIGN_FOLDERS = [FIXTURES / "full_vocab", EAGLE3 / "full_vocab", SPECFORGE / "draft_vocab", EAGLE1 / "llama3",
                   VLLM_MEDUSA / "plain"]


@pytest.mark.parametrize("folder", FOREIGN_FOLDERS, ids=lambda folder: f"{folder.parent.name}/{folder.name}")
def test_a_foreign_draft_given_to_eval_is_told_the_exact_import_command(tmp_path, capsys, folder_target, folder):
    """`drafttrain eval --draft SPECULATORS_FOLDER` loaded it as a draft model: "Unrecognized model", even for a
    sound folder. Refused before the target loads, with the command that imports it, for --draft and --compare."""
    from drafttrain.commands import main

    imported = folder.with_name(folder.name + "-imported")
    command = f"drafttrain import {folder} --target {folder_target} --out {imported} (and give --draft {imported})"
    for flags in (["--draft", str(folder)], ["--proposer", "prompt_lookup", "--compare", str(folder)]):
        capsys.readouterr()
        code = main(["eval", "--target", str(folder_target), *flags, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and "is a draft another tool wrote" in err and "Traceback" not in err, err
        assert command.replace("--draft", flags[-2]) in err, err
        assert not (tmp_path / "out").exists()


def test_a_whole_model_folder_is_a_draft_model_not_a_foreign_draft(folder_target):
    """A Llama folder's config is what EAGLE-1's trainer writes for a head: its weights tell them apart."""
    from drafttrain.drafts.foreign import foreign_draft

    assert foreign_draft(folder_target) is None
    assert foreign_draft(EAGLE1 / "llama3")[0].kind == "eagle"
