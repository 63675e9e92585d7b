"""``drafttrain export``: each kind in each engine's format, read the way that engine reads it, and loaded back.

The engines' reading rules the tests encode (checked against their sources, and for vLLM and speculators by
scripts/tools/check_serving.py serving the exports): vLLM's aux layer id i is the input of layer i (drafttrain's
numbering), SGLang adds 1 to explicit ids, both default to (2, L/2, L-3); vLLM's EAGLE-1 fc has no bias and
``bias: true`` means attention biases; SGLang's EAGLE-1 fc always has one; vLLM's Medusa reads ``token_map``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import draft_vocab_file
from safetensors.torch import load_file
from speculators_venv import speculators_python
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain import DrafttrainError
from drafttrain.config import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.layers import DraftDecoderLayer
from drafttrain.export import export_draft
from drafttrain.runfolder import read_json, verify_manifest, write_manifest
from drafttrain.targets.loading import Target

LORA = {"target_modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8.0, "dropout": 0.0}


def tiny_target(layers: int = 8, vocab: int = 64, seed: int = 0) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Target("tiny", LlamaForCausalLM(config).eval().requires_grad_(False), None)


def randomised(drafter):
    """Trained-looking weights: every parameter random, so a dropped or misplaced tensor shows."""
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    return drafter


def checkpoint_of(drafter, tmp_path):
    return drafter.save_pretrained(tmp_path / "checkpoint")


def read_export(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def same_weights(a, b):
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name


# ---------------------------------------------------------------------------------------------------- EAGLE-3

@pytest.mark.slow
@pytest.mark.parametrize("layers, written", [(None, {"vllm": None, "sglang": None}),
                                             ([1, 3, 6], {"vllm": [1, 3, 6], "sglang": [0, 2, 5]})])
def test_eagle3_layer_ids_are_written_so_each_engine_reads_the_trained_layers(tmp_path, layers, written):
    target = tiny_target(layers=8)
    drafter = randomised(build_drafter(Eagle3Config(layers=layers, ttt_steps=2), target))
    trained = drafter.layer_ids
    assert trained == (layers or [2, 4, 5])  # the default is the engines' (2, L/2, L-3)
    checkpoint = checkpoint_of(drafter, tmp_path)
    for fmt, ids in written.items():
        config, tensors = read_export(export_draft(checkpoint, fmt, tmp_path / fmt, target))
        assert config["eagle_config"].get("eagle_aux_hidden_state_layer_ids") == ids  # None: left to the default
        assert config["eagle_config"]["use_aux_hidden_state"] is True
        assert "bias" not in config and "fc.bias" not in tensors and "midlayer.self_attn.q_proj.weight" in tensors
        back = load_drafter(tmp_path / fmt, target)
        assert back.layer_ids == trained
        same_weights(drafter, back)
    config, tensors = read_export(export_draft(checkpoint, "speculators", tmp_path / "speculators", target))
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == trained
    assert config["norm_before_residual"] is False  # written always: vLLM's speculators reader defaults to True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    # speculators fills embed_tokens from the verifier only when it is NaN: the file must carry the target's own
    assert torch.equal(tensors["embed_tokens.weight"], target.model.get_input_embeddings().weight.detach())
    same_weights(drafter, load_drafter(tmp_path / "speculators", target))


def test_an_exported_eagle3_draft_drafts_exactly_like_its_checkpoint(tmp_path):
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(ttt_steps=2), target)).eval()
    checkpoint = checkpoint_of(drafter, tmp_path)
    back = load_drafter(export_draft(checkpoint, "sglang", tmp_path / "sglang", target), target).eval()
    hidden = torch.randn(1, 5, 3 * 32)
    ids, positions = torch.randint(0, 64, (1, 5)), torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        expected = drafter.step(drafter.fuse(hidden), ids, positions, drafter.new_caches())[1]
        got = back.step(back.fuse(hidden), ids, positions, back.new_caches())[1]
    assert torch.equal(expected, got)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_whole_vocabulary_eagle3_head_is_written_without_a_map_and_loads_back_the_same(tmp_path, fmt):
    """vLLM builds no draft_id_to_target_id for a head over the target's whole vocabulary and refuses a d2t tensor
    at load ("no module or parameter named 'draft_id_to_target_id'", seen serving a fresh head), and speculators
    builds no map either; a head over a draft vocabulary keeps its map."""
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(ttt_steps=2), target)).eval()
    folder = export_draft(checkpoint_of(drafter, tmp_path), fmt, tmp_path / fmt, target)
    config, tensors = read_export(folder)
    assert "d2t" not in tensors and "t2d" not in tensors and config["draft_vocab_size"] == 64
    back = load_drafter(folder, target)
    assert torch.equal(back.d2t, drafter.d2t) and torch.equal(back.t2d, drafter.t2d)
    vocab = draft_vocab_file(tmp_path, range(16), 64)
    smaller = randomised(build_drafter(Eagle3Config(ttt_steps=2, draft_vocab=str(vocab)), target)).eval()
    smaller_folder = export_draft(smaller.save_pretrained(tmp_path / "small"), fmt, tmp_path / "small-export", target)
    _, tensors = read_export(smaller_folder)
    assert tensors["d2t"].numel() == 16 and tensors["t2d"].numel() == 64


def test_an_eagle31_head_writes_its_norms_where_vllm_and_speculators_read_them_and_refuses_sglang(tmp_path):
    """vLLM reads ``fc_norm``/``norm_output`` from the draft's config (speculators' converter copies them from the
    top level) and the per-tap norms as ``fc_norm.{i}.weight``; SGLang is not known to read them, so it is refused
    rather than served a file it would load without them."""
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(ttt_steps=2, fc_norm=True, norm_output=True), target)).eval()
    checkpoint = checkpoint_of(drafter, tmp_path)
    hidden = torch.randn(1, 5, 3 * 32)
    ids, positions = torch.randint(0, 64, (1, 5)), torch.arange(5).unsqueeze(0)
    for fmt in ("vllm", "speculators"):
        folder = export_draft(checkpoint, fmt, tmp_path / fmt, target)
        config, tensors = read_export(folder)
        assert config["fc_norm"] is True and config["norm_output"] is True
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
        back = load_drafter(folder, target).eval()
        with torch.no_grad():  # two steps: the second reads the first one's (normed) output
            caches, back_caches = drafter.new_caches(), back.new_caches()
            h, _ = drafter.step(drafter.fuse(hidden), ids, positions, caches)
            h_back, _ = back.step(back.fuse(hidden), ids, positions, back_caches)
            expected = drafter.step(h[:, -1:], ids[:, :1], positions[:, -1:] + 1, caches)[1]
            got = back.step(h_back[:, -1:], ids[:, :1], positions[:, -1:] + 1, back_caches)[1]
        assert torch.equal(expected, got)
    plain_config, _ = read_export(export_draft(checkpoint_of(randomised(build_drafter(
        Eagle3Config(ttt_steps=2), target)), tmp_path / "plain"), "vllm", tmp_path / "plain-vllm", target))
    assert "fc_norm" not in plain_config and "norm_output" not in plain_config  # the readers' default: off
    with pytest.raises(DrafttrainError, match=r"EAGLE-3.1 or sliding-window head \(fc_norm, norm_output\).*not 'sglang'"):
        export_draft(checkpoint, "sglang", tmp_path / "sglang", target)


def test_a_sliding_window_head_writes_its_window_where_vllm_s_llama_layer_reads_it(tmp_path):
    """vLLM's Llama layer takes a draft layer's window from ``layer_types`` and ``sliding_window`` of the config it
    is built from (the top level in vLLM's format, ``transformer_layer_config`` in speculators'); the head loads back
    with its window and drafts as before."""
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(ttt_steps=2, sliding_window=4), target)).eval()
    checkpoint = checkpoint_of(drafter, tmp_path)
    hidden, ids, positions = torch.randn(1, 9, 3 * 32), torch.randint(0, 64, (1, 9)), torch.arange(9)[None]
    with torch.no_grad():
        expected = drafter.step(drafter.fuse(hidden), ids, positions, drafter.new_caches())[1]
    for fmt, section in (("vllm", lambda c: c), ("speculators", lambda c: c["transformer_layer_config"])):
        folder = export_draft(checkpoint, fmt, tmp_path / fmt, target)
        layer = section(read_export(folder)[0])
        assert layer["sliding_window"] == 4 and layer["layer_types"] == ["sliding_attention"]
        back = load_drafter(folder, target).eval()
        with torch.no_grad():
            assert torch.equal(back.step(back.fuse(hidden), ids, positions, back.new_caches())[1], expected)
    with pytest.raises(DrafttrainError, match=r"sliding-window head \(sliding_window\).*not 'sglang'"):
        export_draft(checkpoint, "sglang", tmp_path / "sglang", target)


# ---------------------------------------------------------------------------------------------------- EAGLE-1

def vllm_eagle1_forward(config, tensors, embeds, hidden, positions, rotary):
    """EAGLE-1 as vLLM builds it from an export: fc without a bias, layer 0 without an input norm, attention
    biases wherever the config says ``attention_bias`` (our own decoder layer, built with that config)."""
    layer_config = LlamaConfig(**{k: v for k, v in config.items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "vocab_size")}, attention_bias=config.get("attention_bias", False))
    layer = DraftDecoderLayer(layer_config, fuse_embedding=False, input_norm=False)
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")})
    assert "fc.bias" not in tensors
    x = torch.cat([embeds, hidden], dim=-1) @ tensors["fc.weight"].T
    cos, sin = rotary(x, positions)
    from drafttrain.drafts.layers import LayerCache

    return layer(x, None, cos, sin, LayerCache())


def test_eagle1_for_vllm_folds_the_fc_bias_into_attention_and_computes_the_same(tmp_path):
    target = tiny_target()
    drafter = randomised(build_drafter(EagleConfig(), target)).eval()
    assert drafter.fc.bias.abs().sum() > 0
    config, tensors = read_export(export_draft(checkpoint_of(drafter, tmp_path), "vllm", tmp_path / "vllm", target))
    # vLLM would build attention biases from "bias" and never find them: the export says attention_bias instead
    assert "bias" not in config and config["attention_bias"] is True
    embeds, hidden = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    positions = torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        theirs = vllm_eagle1_forward(config, tensors, embeds, hidden, positions, drafter.rotary)
        x = drafter.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = drafter.rotary(x, positions)
        from drafttrain.drafts.layers import LayerCache

        ours = drafter.layers["0"](x, None, cos, sin, LayerCache())
    assert torch.allclose(theirs, ours, atol=1e-5)
    same_weights(drafter, load_drafter(tmp_path / "vllm", target))


def test_eagle1_for_sglang_keeps_the_fc_bias_and_no_attention_bias(tmp_path):
    """SGLang's EAGLE-1 fc always has a bias (left random when missing), and ``bias``/``attention_bias`` would give
    every attention projection one that the head never had."""
    target = tiny_target()
    drafter = randomised(build_drafter(EagleConfig(), target))
    config, tensors = read_export(export_draft(checkpoint_of(drafter, tmp_path), "sglang", tmp_path / "sglang", target))
    assert "bias" not in config and not config.get("attention_bias")
    assert torch.equal(tensors["fc.bias"], drafter.fc.bias)
    assert not any(k.endswith("_proj.bias") for k in tensors)
    same_weights(drafter, load_drafter(tmp_path / "sglang", target))


def test_a_vllm_eagle1_folder_with_real_attention_biases_is_refused(tmp_path):
    target = tiny_target()
    drafter = randomised(build_drafter(EagleConfig(), target))
    folder = export_draft(checkpoint_of(drafter, tmp_path), "vllm", tmp_path / "vllm", target)
    config, tensors = read_export(folder)
    tensors["layers.0.self_attn.k_proj.bias"] += 1.0
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "manifest.json").unlink()  # edited on purpose: the manifest would (rightly) refuse it first
    with pytest.raises(DrafttrainError, match="not a folded fc bias"):
        load_drafter(folder, target)


# ----------------------------------------------------------------------------------------------------- Medusa

def test_medusa_for_vllm_is_its_heads_over_the_full_vocabulary(tmp_path):
    from drafttrain.drafts.medusa import MedusaDrafter

    target = tiny_target()
    drafter = randomised(build_drafter(MedusaConfig(num_heads=3), target))
    config, tensors = read_export(export_draft(checkpoint_of(drafter, tmp_path), "vllm", tmp_path / "vllm", target))
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["medusa_fc_bias"]
    assert config["vocab_size"] == 64 and config.get("truncated_vocab_size") is None
    assert set(tensors) == {*(f"lm_heads.{h}.weight" for h in range(3)),
                            *(f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias"))}
    same_weights(drafter, load_drafter(tmp_path / "vllm", target))
    # vLLM 0.32 builds Medusa heads at the full vocabulary and refuses a token_map: a draft vocabulary is refused
    keep = torch.tensor([1, 5, 9, 20, 33, 63])
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[keep] = True
    truncated = MedusaDrafter(MedusaConfig(num_heads=3), 32, keep - torch.arange(6), t2d).attach_target(target)
    with pytest.raises(DrafttrainError, match="draft_vocab.enabled: false"):
        export_draft(truncated.save_pretrained(tmp_path / "truncated"), "vllm", tmp_path / "t", target)


def test_medusa2_exports_its_adapted_target_merged(tmp_path):
    target = tiny_target()
    drafter = build_drafter(MedusaConfig(num_heads=2, target_lora=LORA), target)
    with torch.no_grad():
        for name, param in target.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        adapted = target.model(ids).logits
    checkpoint = checkpoint_of(drafter, tmp_path)
    folder = export_draft(checkpoint, "vllm", tmp_path / "vllm", tiny_target())
    merged = LlamaForCausalLM.from_pretrained(folder / "target")
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-5)
    assert "target/" in (folder / "README.md").read_text() and not (folder / "adapter").exists()


# ------------------------------------------------------------------------------------------ the folder itself

def test_an_export_refuses_to_overwrite_and_a_format_its_kind_lacks(tmp_path):
    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(EagleConfig(), target), tmp_path)
    export_draft(checkpoint, "vllm", tmp_path / "out", target)
    with pytest.raises(DrafttrainError, match="--overwrite"):
        export_draft(checkpoint, "vllm", tmp_path / "out", target)
    export_draft(checkpoint, "sglang", tmp_path / "out", target, overwrite=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["drafttrain"]["export"]["format"] == "sglang"
    with pytest.raises(DrafttrainError, match="eagle draft exports to vllm, sglang, not speculators"):
        export_draft(checkpoint, "speculators", tmp_path / "other", target)
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob("*.partial"))
    built_from = verify_manifest(tmp_path / "out")
    assert built_from["format"] == "sglang" and built_from["kind"] == "eagle"


def report_for(drafter, tau: float, sha: str | None) -> dict:
    per = {"conditional": [0.6, 0.5], "cumulative": [0.6, 0.3]}
    overall = {"num_prompts": 4, "tau": tau, "acceptance_rate": 0.45, "speedup": 1.31, "greedy_match": 1.0,
               "acceptance_per_position": per}
    return {"config": {"suite": "mt_bench", "temperature": 0.0, "depth": 2, "tree": "chain", "proposer": "eagle",
                       "target": "tiny", "threads": 2, "dtype": "float32", "machine": {"cpu_count": 2},
                       "draft": {"kind": drafter.kind, "path": "x", "weights_sha256": sha}},
            "overall": overall, "categories": {"writing": overall}, "prompts": []}


def test_the_card_shows_the_report_that_measured_these_weights_and_refuses_another(tmp_path):
    from drafttrain.runfolder import file_sha256

    target = tiny_target()
    drafter = build_drafter(Eagle3Config(ttt_steps=2), target)
    checkpoint = checkpoint_of(drafter, tmp_path)
    unmeasured = export_draft(checkpoint, "vllm", tmp_path / "plain", target)
    assert "Not measured" in (unmeasured / "README.md").read_text()
    sha = file_sha256(checkpoint / "model.safetensors")
    (tmp_path / "mine.json").write_text(json.dumps(report_for(drafter, 2.37, sha)))
    folder = export_draft(checkpoint, "vllm", tmp_path / "measured", target, report=tmp_path / "mine.json")
    card = (folder / "README.md").read_text()
    assert "| 2.37 |" in card and "1.31×" in card and "| conditional | 60.0% | 50.0% |" in card
    assert card.startswith("---\n") and "speculative-decoding" in card and "library_name: drafttrain" in card
    assert (folder / "acceptance.png").stat().st_size > 1000
    assert json.loads((folder / "eval" / "report.json").read_text())["overall"]["tau"] == 2.37
    (tmp_path / "other.json").write_text(json.dumps(report_for(drafter, 9.9, "0" * 64)))
    with pytest.raises(DrafttrainError, match="measured other weights"):
        export_draft(checkpoint, "vllm", tmp_path / "wrong", target, report=tmp_path / "other.json")


def test_the_export_command_writes_a_run_s_best_checkpoint(tmp_path, smollm2):
    """On the real target, through the command line: the draft recorded its target, so none is named."""
    from drafttrain.commands import main

    drafter = build_drafter(Eagle3Config(ttt_steps=2), smollm2)
    drafter.save_pretrained(tmp_path / "checkpoint")
    assert main(["export", str(tmp_path / "checkpoint"), "--format", "speculators", "--out", str(tmp_path / "s")]) == 0
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    card = (tmp_path / "s" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "license: apache-2.0" in card


# ------------------------------------------------------------------------------------------------------ push

def push(folder, *args, endpoint, token):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "drafttrain", "push", str(folder), *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_push_uploads_the_export_with_its_card_to_the_hub_and_never_prints_the_token(tmp_path):
    from fake_hub import FakeHub

    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(Eagle3Config(ttt_steps=2), target), tmp_path)
    folder = export_draft(checkpoint, "vllm", tmp_path / "export", target)
    token = "hf_secretsecretsecret"
    with FakeHub(token) as hub:
        dry = push(folder, "--repo", "me/draft", "--dry-run", endpoint=hub.endpoint, token=token)
        assert dry.returncode == 0 and "model.safetensors" in dry.stdout and not hub.requests
        done = push(folder, "--repo", "me/draft", "--private", "--revision", "v1", endpoint=hub.endpoint, token=token)
        assert done.returncode == 0, done.stderr
        uploaded = hub.repos["me/draft"]["revisions"]["v1"]
        assert hub.repos["me/draft"]["private"] and all(authorised for *_, authorised in hub.requests)
        local = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert uploaded == local and "README.md" in uploaded and "eval/report.json" not in uploaded  # unmeasured
        wrong = push(folder, "--repo", "me/draft", endpoint=hub.endpoint, token="hf_wrong")
        assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr and "HF_TOKEN" in wrong.stderr
    for run in (dry, done, wrong):
        assert token not in run.stdout + run.stderr and "hf_wrong" not in run.stdout + run.stderr


def test_a_push_that_must_fail_fails_in_a_dry_run_too_and_offline_pushes_name_the_cause(tmp_path, monkeypatch,
                                                                                        capsys):
    """A bad repo id fails the dry run (it passed before); a push without a token, or to a Hub that cannot be
    reached, ends in a named cause, not a traceback."""
    from drafttrain.commands import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token stored by `hf auth login` either
    target = tiny_target()
    folder = export_draft(checkpoint_of(build_drafter(EagleConfig(), target), tmp_path), "vllm", tmp_path / "e", target)
    for repo in ("not a repo!!", "a/b/c"):  # refused before any Hub call: in this process
        assert main(["push", str(folder), "--repo", repo, "--dry-run"]) == 2
        assert "is not a Hub repo id" in capsys.readouterr().err
    unreachable = push(folder, "--repo", "me/draft", endpoint="http://127.0.0.1:9", token="hf_x")
    assert unreachable.returncode == 2 and "pushing to me/draft failed" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr and "hf_x" not in unreachable.stderr
    no_token = push(folder, "--repo", "me/draft", endpoint="http://127.0.0.1:9", token="")
    assert no_token.returncode == 2 and "no Hugging Face token" in no_token.stderr, no_token.stderr


def test_an_export_whose_engine_config_disagrees_with_its_weights_is_refused(tmp_path):
    """A Medusa export whose config.json says 2 heads over weights of 3 loaded and evaluated as 3 heads, while vLLM
    would serve 2: refused now, naming the key."""
    target = tiny_target()
    folder = export_draft(checkpoint_of(build_drafter(MedusaConfig(num_heads=3), target), tmp_path), "vllm",
                          tmp_path / "medusa", target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_heads": 2}))
    write_manifest(folder, read_json(folder / "manifest.json")["built_from"], skip=("README.md",))  # as if written so
    with pytest.raises(DrafttrainError, match="says num_heads = 2, but the draft it holds has 3"):
        load_drafter(folder, target)


def test_an_edited_model_card_neither_breaks_loading_nor_a_push(tmp_path, capsys):
    """Hand-editing README.md is the usual step before publishing: the weights and configs stay checked."""
    from drafttrain.commands import main

    target = tiny_target()
    folder = export_draft(checkpoint_of(build_drafter(EagleConfig(), target), tmp_path), "vllm", tmp_path / "e", target)
    (folder / "README.md").write_text((folder / "README.md").read_text() + "\nEdited by hand before publishing.\n")
    load_drafter(folder, target)
    assert main(["push", str(folder), "--repo", "me/x", "--dry-run"]) == 0, capsys.readouterr().err
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("{", "{ ", 1))
    assert main(["push", str(folder), "--repo", "me/x", "--dry-run"]) == 2  # the config is still checked


def test_push_refuses_a_folder_without_a_draft_and_an_export_changed_since_it_was_written(tmp_path, capsys):
    from drafttrain.commands import main

    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(EagleConfig(), target), tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["push", str(tmp_path / "empty"), "--repo", "me/x", "--dry-run"]) == 2
    assert "no draft checkpoint" in capsys.readouterr().err
    folder = export_draft(checkpoint, "vllm", tmp_path / "export", target)
    with (folder / "model.safetensors").open("r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    assert main(["push", str(folder), "--repo", "me/x", "--dry-run"]) == 2
    assert "model.safetensors" in capsys.readouterr().err


def test_a_damaged_draft_model_or_adapter_folder_is_named_not_a_traceback(tmp_path):
    """Folders read by transformers or peft (no manifest, as `save_pretrained` writes them alone)."""
    from drafttrain.config import DraftModelConfig

    target = tiny_target(layers=4)
    student = build_drafter(DraftModelConfig(cut="every:2"), target)
    folder = student.save_pretrained(tmp_path / "student")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DrafttrainError, match="student.*cannot be read|model.safetensors"):
        load_drafter(folder, target)
    medusa = build_drafter(MedusaConfig(num_heads=2, target_lora=LORA), tiny_target())
    folder = medusa.save_pretrained(tmp_path / "medusa2")
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DrafttrainError, match="adapter_model.safetensors|cannot be read"):
        load_drafter(folder, tiny_target())


@pytest.mark.slow
@pytest.mark.parametrize("config", [pytest.param(Eagle3Config(), id="eagle3"),
                                    pytest.param(DFlashConfig(num_layers=2, block_size=4), id="dflash"),
                                    pytest.param(Eagle3Config(parallel={"depths": 4}), id="peagle"),
                                    pytest.param(Eagle3Config(fc_norm=True, norm_output=True), id="eagle31")])
def test_speculators_own_classes_load_the_export_and_draft_what_ours_does(tmp_path, smollm2, config):
    """The export loaded by speculators' own model class (EAGLE-3: its token embeddings included, since an export
    without them loads them as zeros; DFlash: its blocks drafted by speculators' forward at our anchors) predicts
    the same draft tokens as our draft from the same target hidden states."""
    drafter = build_drafter(config, smollm2)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.02)
    checkpoint = drafter.save_pretrained(tmp_path / "checkpoint")
    script = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "check_speculators_load.py"
    done = subprocess.run([sys.executable, str(script), str(checkpoint), "--speculators-python", speculators_python(),
                           "--num-prompts", "1", "--max-new-tokens", "24", "--out", str(tmp_path / "check")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "check" / "speculators_check.json").read_text())
    assert result["draft_tokens_equal"] == result["positions"] > 0 and not result["embed_zero"]



def test_a_p_eagle_head_names_the_formats_it_exports_to(tmp_path):
    """Asked for hf, a P-EAGLE head answered "a eagle3 draft exports to vllm, sglang, speculators", and then vllm
    and sglang were refused for it: the formats named are the ones this draft can be written in."""
    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(Eagle3Config(parallel={"depths": 3}), target), tmp_path)
    with pytest.raises(DrafttrainError, match=r"exports to speculators, not hf \(--format speculators\)"):
        export_draft(checkpoint, "hf", tmp_path / "hf", target)
    with pytest.raises(DrafttrainError, match="P-EAGLE head .* is served from speculators' format"):
        export_draft(checkpoint, "vllm", tmp_path / "vllm", target)


def test_an_export_that_cannot_be_written_is_one_line_naming_the_place(tmp_path):
    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(EagleConfig(), target), tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    with pytest.raises(DrafttrainError, match=r"cannot write the export's staging folder .*blocker/out.partial: a "
                                              r"(part of the path is a file|file is there)"):
        export_draft(checkpoint, "vllm", blocker / "out", target)
