"""EAGLE heads: shapes, the training-time-test attention, gradients, save/load layout, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain import DrafttrainError
from drafttrain.config import parse_recipe
from drafttrain.drafts import build_draft, load_draft
from drafttrain.drafts.eagle import EagleConfig
from drafttrain.drafts.eagle3 import Eagle3Config
from drafttrain.targets.loading import Target
from drafttrain.training.features import FeatureCache, compute_features, write_feature_cache


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Target("tiny-llama", LlamaForCausalLM(cfg).eval().requires_grad_(False), tokenizer=None)


def batch_of(target, batch=2, seq=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones(batch, seq), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def vocab_file(tmp_path, vocab: int, keep: list[int]):
    keep = sorted(keep)
    d2t = torch.tensor([t - i for i, t in enumerate(keep)], dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    path = tmp_path / "draft_vocab.safetensors"
    save_file({"d2t": d2t, "t2d": t2d}, str(path))
    return path


@pytest.mark.parametrize("cfg", [Eagle3Config(ttt_steps=3), Eagle3Config(num_layers=2, ttt_steps=2), EagleConfig()])
def test_training_step_shapes_and_finite_loss(tiny_target, cfg):
    draft = build_draft(cfg, tiny_target)
    batch = batch_of(tiny_target)
    features = compute_features(tiny_target, batch, draft.target_layers)
    width = 3 * 32 if cfg.kind == "eagle3" else 32
    assert features.hidden.shape == (2, 24, width) and features.logits.shape == (2, 24, 96)
    out = draft.training_step(batch, features)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert len(out.step_accuracies) == (cfg.ttt_steps if cfg.kind == "eagle3" else 1)


def test_eagle3_default_taps_are_inputs_of_layers_2_mid_and_L_minus_3(tiny_target):
    assert build_draft(Eagle3Config(), tiny_target).target_layers == [2, 3, 3]


def test_ttt_step_equals_cached_inference_along_the_drafted_path(tiny_target):
    """The TTT attention must reproduce what the draft computes at inference: real keys up to t, then its own
    keys for t+1..t+i. Feeding the true tokens at inference (teacher forcing) makes both paths identical."""
    torch.manual_seed(1)
    draft = build_draft(Eagle3Config(ttt_steps=4), tiny_target).eval()
    for p in draft.parameters():  # non-trivial weights so a wrong mask changes the result
        torch.nn.init.normal_(p, std=0.2)
    batch = batch_of(tiny_target, batch=1, seq=16, seed=3)
    ids = batch["input_ids"]
    features = compute_features(tiny_target, batch, draft.target_layers)
    fused = draft.fuse(features.hidden)

    # Training path: collect each TTT step's hidden output at every position.
    step_outputs = []
    original = draft.midlayer.forward_ttt

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        step_outputs.append(out)
        return out

    draft.midlayer.forward_ttt = spy
    with torch.no_grad():
        draft.training_step(batch, features)
    del draft.midlayer.forward_ttt

    t = 9  # check position t for every unrolled step
    with torch.no_grad():
        caches = draft.new_caches()
        positions = torch.arange(t + 1).unsqueeze(0)
        h, _ = draft.step(fused[:, : t + 1], ids[:, 1 : t + 2], positions, caches)
        hidden = h[:, -1:]
        assert torch.allclose(hidden, step_outputs[0][:, t : t + 1], atol=1e-5)
        for i in range(1, 4):
            hidden, _ = draft.step(hidden, ids[:, t + 1 + i : t + 2 + i], torch.tensor([[t + i]]), caches)
            assert torch.allclose(hidden, step_outputs[i][:, t : t + 1], atol=1e-5), f"step {i} differs"


def test_a_wrong_ttt_mask_would_be_caught(tiny_target):
    """Guard for the test above: letting step 1 see the step-0 key of position t+1 changes the output."""
    torch.manual_seed(1)
    draft = build_draft(Eagle3Config(ttt_steps=2), tiny_target).eval()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    batch = batch_of(tiny_target, batch=1, seq=12, seed=3)
    features = compute_features(tiny_target, batch, draft.target_layers)
    with torch.no_grad():
        fused = draft.fuse(features.hidden)
        caches = draft.new_caches()
        ids = batch["input_ids"]
        h_right, _ = draft.step(fused[:, :6], ids[:, 1:7], torch.arange(6).unsqueeze(0), caches)
        right, _ = draft.step(h_right[:, -1:], ids[:, 7:8], torch.tensor([[6]]), caches)
        caches = draft.new_caches()
        h_wrong, _ = draft.step(fused[:, :7], ids[:, 1:8], torch.arange(7).unsqueeze(0), caches)  # leaks t+1
        wrong, _ = draft.step(h_right[:, -1:], ids[:, 7:8], torch.tensor([[6]]), caches)
    assert not torch.allclose(right, wrong, atol=1e-4)


@pytest.mark.parametrize("cfg", [Eagle3Config(ttt_steps=2), EagleConfig()])
def test_gradients_reach_only_draft_parameters(tiny_target, cfg):
    draft = build_draft(cfg, tiny_target).train()
    batch = batch_of(tiny_target)
    draft.training_step(batch, compute_features(tiny_target, batch, draft.target_layers)).loss.backward()
    assert all(p.grad is None for p in tiny_target.model.parameters())
    target_ids = {id(p) for p in tiny_target.model.parameters()}
    assert not any(id(p) in target_ids for p in draft.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in draft.parameters())


def test_eagle3_checkpoint_uses_the_interchange_layout(tiny_target, tmp_path):
    vocab = vocab_file(tmp_path, 96, keep=list(range(0, 96, 3)))
    draft = build_draft(Eagle3Config(draft_vocab=str(vocab)), tiny_target)
    draft.save_pretrained(tmp_path / "ckpt")
    names = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"} <= names
    assert not any("embed_tokens" in n for n in names), "the target's embedding must not be saved"
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 32 and config["vocab_size"] == 96
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == draft.target_layers
    loaded = load_draft(tmp_path / "ckpt", tiny_target)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.state_dict()["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # 2H input


def test_eagle3_draft_vocab_restricts_logits_to_kept_ids(tiny_target, tmp_path):
    keep = list(range(5, 96, 4))
    draft = build_draft(Eagle3Config(draft_vocab=str(vocab_file(tmp_path, 96, keep))), tiny_target)
    assert draft.draft_to_target.tolist() == keep
    h = torch.randn(1, 3, 32)
    _, logits = draft.step(h, torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0), draft.new_caches())
    assert logits.shape[-1] == 96
    assert set(logits[0, -1].isfinite().nonzero().flatten().tolist()) == set(keep)


def test_bad_input_is_refused_clearly(tiny_target, tmp_path):
    with pytest.raises(DrafttrainError, match="layer 9 does not exist"):
        build_draft(Eagle3Config(layers=[1, 2, 9]), tiny_target)
    big = tmp_path / "big.safetensors"
    save_file({"d2t": torch.zeros(97, dtype=torch.long), "t2d": torch.ones(96, dtype=torch.bool)}, str(big))
    with pytest.raises(DrafttrainError, match="larger than the target"):
        build_draft(Eagle3Config(draft_vocab=str(big)), tiny_target)
    other = tmp_path / "other.safetensors"
    save_file({"d2t": torch.zeros(8, dtype=torch.long), "t2d": torch.ones(50, dtype=torch.bool)}, str(other))
    with pytest.raises(DrafttrainError, match="vocabulary of 50 tokens"):
        build_draft(Eagle3Config(draft_vocab=str(other)), tiny_target)
    with pytest.raises(DrafttrainError, match="not found"):
        build_draft(Eagle3Config(draft_vocab=str(tmp_path / "none.safetensors")), tiny_target)


def test_recipe_rejects_unknown_draft_kind_and_keys():
    with pytest.raises(DrafttrainError, match="draft"):
        parse_recipe({"draft": {"kind": "nope"}})
    with pytest.raises(DrafttrainError, match=r"draft\.ttt_step.*unknown key"):
        parse_recipe({"draft": {"kind": "eagle3", "ttt_step": 3}})
    assert parse_recipe({"draft": {"kind": "eagle3", "ttt_steps": 3}}).draft.ttt_steps == 3


def test_offline_cache_matches_online_features_and_detects_corruption(tiny_target, tmp_path):
    import datasets

    rows = [{"input_ids": torch.randint(0, 96, (n,)).tolist()} for n in (10, 14, 7)]
    dataset = datasets.Dataset.from_list(rows)
    layers = [2, 3, 3]
    cache_dir = write_feature_cache(tiny_target, dataset, layers, tmp_path / "cache", rows_per_shard=2, dtype=torch.float32)
    cache = FeatureCache(cache_dir, tiny_target, layers)
    ids = torch.tensor(rows[1]["input_ids"]).unsqueeze(0)
    online = compute_features(tiny_target, {"input_ids": ids}, layers)
    offline = cache.features([1], seq_len=14)
    assert torch.allclose(online.hidden, offline.hidden, atol=1e-5)
    assert torch.allclose(online.logits, offline.logits, atol=1e-4)

    with pytest.raises(DrafttrainError, match="layers"):
        FeatureCache(cache_dir, tiny_target, [1, 2, 3])
    shard = cache_dir / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    with pytest.raises(DrafttrainError, match="corrupt"):
        FeatureCache(cache_dir, tiny_target, layers).features([2], seq_len=7)
    wide = Target("wide", LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)), None)
    with pytest.raises(DrafttrainError, match="hidden size 32"):
        FeatureCache(cache_dir, wide, layers)
