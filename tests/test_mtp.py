"""The ``mtp`` kind: a family's own multi-token-prediction layer (DeepSeek-V3 / Kimi-K2, GLM-4.5, Qwen3-Next, Qwen3.5
dense and MoE), on tiny random targets saved as model folders whose checkpoints ship an MTP layer under the published
keys (tests/families.py, written by transformers alone).

Checked for each family: the native layer reads as transformers' own MtpModel.from_pretrained reads it (tensor
equality); training unrolls its draft steps exactly as decoding runs them; greedy speculative decoding is the
target's; checkpoints and both exports (the layer alone for vLLM, the target stitched with it) read back to the same
tensors, the stitched folder loading in transformers' MtpModel and the export keeping the published keys; sampling
follows the target (a chi-squared test that a broken sampler fails); and the whole command path, prepare -> train ->
checkpoint evaluation -> export -> import -> eval.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fitted_on_its_answer, small_recipe
from families import MTP_FAMILIES, family_model, mtp_ready, save_with_native_mtp
from safetensors.torch import load_file
from test_decoding_sampling import BROKEN_THRESHOLD, P_THRESHOLD, _TinyTokenizer
from test_family_sampling import SAMPLES, V, joint_pvalue
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.config import parse_recipe
from drafttrain.decoding import DynamicTree, SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.export.importer import import_draft
from drafttrain.export.writer import export_draft
from drafttrain.targets import Target, load_target, load_tokenizer, run_target

RECURRENT = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}  # linear-attention targets: chains only


def mtp_section(**fields):
    return parse_recipe({"draft": {"kind": "mtp", **fields}}).draft


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def native(tmp_path_factory, tokenizer):
    """family -> (its model folder shipping an MTP layer, that layer's state)."""
    made = {}

    def make(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            made[family] = folder, save_with_native_mtp(family_model(family), folder, tokenizer)
        return made[family]

    return make


def prompt_of(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a cat and a dog."}],
                                         add_generation_prompt=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_the_native_layer_reads_as_transformers_mtp_model_reads_it(family, native):
    folder, shipped = native(family)
    target = load_target(str(folder))
    drafter = build_drafter(mtp_section(), target)
    ours = drafter.layer.state_dict()
    theirs = MtpModel.from_pretrained(mtp_ready(AutoModelForCausalLM.from_pretrained(folder))).layers[0].state_dict()
    assert sorted(ours) == sorted(theirs) == sorted(shipped)
    for name in shipped:
        assert torch.equal(ours[name], theirs[name]) and torch.equal(ours[name], shipped[name]), name


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_training_unrolls_the_draft_steps_exactly_as_decoding_runs_them(family, tokenizer):
    """Step k at anchor t in one training forward (the first step's keys up to t, its own earlier steps' at t) gives
    the logits the proposer's cache gives when it drafts k tokens after the text up to t."""
    target = Target(family, family_model(family), tokenizer)
    torch.manual_seed(0)
    drafter = build_drafter(mtp_section(init_from_target=[]), target).eval()
    ids = torch.randint(3, 2000, (1, 14), generator=torch.Generator().manual_seed(1))
    hidden = run_target(target, {"input_ids": ids}, drafter.needs()).hidden
    steps = 3
    with torch.no_grad():
        trained = list(drafter.unrolled(ids, torch.ones_like(ids), hidden, steps))
        for t in range(ids.shape[1] - steps - 1):
            caches = drafter.new_caches()
            out, logits = drafter.step(hidden[:, : t + 1], ids[:, 1: t + 2], torch.arange(t + 1)[None], caches)
            torch.testing.assert_close(logits[0, -1], trained[0][0, t], atol=1e-4, rtol=1e-4)
            out = out[:, -1:]
            for k in range(1, steps):
                seen = torch.ones(1, t + 1 + k, dtype=torch.bool)
                out, logits = drafter.step(out, ids[:, t + 1 + k: t + 2 + k], torch.tensor([[t + k]]), caches, seen)
                torch.testing.assert_close(logits[0, -1], trained[k][0, t], atol=1e-4, rtol=1e-4)


def fitted(target: Target, prompt: list[int], steps: int) -> torch.nn.Module:
    """A fresh MTP layer trained ``steps`` steps on the target's greedy answer to ``prompt``."""
    drafter, *_ = fitted_on_its_answer(target, mtp_section(init_from_target=[], steps=2), steps, 3e-3, prompt)
    assert not any(p.grad is not None for p in target.model.parameters())  # the target stays frozen
    return drafter


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_speculative_decoding_is_the_targets(family, tokenizer, one_thread):
    target = Target(family, family_model(family), tokenizer)
    prompt = prompt_of(tokenizer)
    reference = plain_decode(target, prompt, 40).tokens
    shapes = [dict(depth=3)] + ([] if family in RECURRENT else [dict(tree=DynamicTree(total_tokens=8, depth=3,
                                                                                         top_k=3))])
    accepted = refused = 0
    for steps in (0, 4):  # a fresh layer (its drafts mostly refused) and one fitted to the answer
        drafter = fitted(target, prompt, steps)
        for shape in shapes:
            out = SpeculativeDecoder(target, build_proposer("eagle", target, draft=drafter), **shape) \
                .generate(prompt, 40)
            assert out.tokens == reference, (steps, shape)
            accepted += sum(out.stats.accepted_per_step)
            refused += sum(out.stats.rejected_per_step)
    assert accepted > 0 and refused > 0


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_checkpoints_and_exports_read_back_under_the_published_keys(family, native, tmp_path):
    folder, shipped = native(family)
    target = load_target(str(folder))
    drafter = build_drafter(mtp_section(), target)
    with torch.no_grad():  # a layer that differs from the shipped one
        for param in drafter.parameters():
            param.add_(0.01)
    trained = {k: v.clone() for k, v in drafter.layer.state_dict().items()}
    drafter.save_pretrained(tmp_path / "checkpoint")
    loaded = load_drafter(tmp_path / "checkpoint", target)
    assert all(torch.equal(loaded.layer.state_dict()[k], v) for k, v in trained.items())

    published = load_file(str(folder / "model.safetensors"))
    for fmt in ("vllm", "hf"):
        export = export_draft(tmp_path / "checkpoint", fmt, tmp_path / fmt, target)
        back = load_drafter(export, target)
        assert all(torch.equal(back.layer.state_dict()[k], v) for k, v in trained.items()), fmt
        config = json.loads((export / "config.json").read_text())
        assert config["model_type"] == target.config.model_type and config["drafttrain"]["export"]["format"] == fmt
    # the layer alone, under exactly the keys the target's checkpoint ships it under (less the copies of the
    # embedding and lm_head, which the engines take from the target)
    alone = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    ships = {k for k in published if k.startswith(("mtp.", f"model.layers.{target.num_layers}."))}
    assert set(alone) == ships - {k for k in ships if k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    # the stitched target loads in transformers, and its MtpModel reads the trained layer
    stitched = mtp_ready(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))
    theirs = MtpModel.from_pretrained(stitched).layers[0].state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in trained.items())
    for name, value in target.model.state_dict().items():
        assert torch.equal(stitched.state_dict()[name], value), name


def test_a_target_without_mtp_weights_or_family_is_refused_naming_the_way_out(tokenizer, folder_target):
    with pytest.raises(DrafttrainError, match="ships no MTP layer.*init_from_target to \\[layer\\]"):
        build_drafter(mtp_section(), Target("glm", family_model("glm4_moe"), tokenizer))
    with pytest.raises(DrafttrainError, match="not a family whose MTP layers"):
        build_drafter(mtp_section(init_from_target=[]), load_target(str(folder_target)))
    with pytest.raises(Exception, match="'native' or 'layer', not both"):
        mtp_section(init_from_target=["native", "layer"])


def test_layer_starts_from_the_targets_last_decoder_layer_and_final_norm(tokenizer):
    target = Target("deepseek", family_model("deepseek_v3"), tokenizer)
    drafter = build_drafter(mtp_section(init_from_target=["layer"]), target)
    last = target.model.model.layers[-1].state_dict()
    assert all(torch.equal(drafter.layer.mtp_block.state_dict()[k], v) for k, v in last.items())
    assert torch.equal(drafter.layer.post_norm.weight, target.model.model.norm.weight)
    with pytest.raises(DrafttrainError, match="last decoder layer is not of the MTP layer's shape"):
        build_drafter(mtp_section(init_from_target=["layer"]),
                      Target("qwen3_next", family_model("qwen3_next", layer_types=["full_attention"] * 3
                                                        + ["linear_attention"]), tokenizer))


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_published_models_own_layer_imports_as_a_checkpoint(family, native, tmp_path):
    folder, shipped = native(family)
    target = load_target(str(folder))
    out, _ = import_draft(folder, target, tmp_path / "imported")
    drafter = load_drafter(out, target)
    assert drafter.kind == "mtp" and all(torch.equal(drafter.layer.state_dict()[k], v) for k, v in shipped.items())
    with pytest.raises(DrafttrainError, match="import a model's MTP layer for that model"):
        other = "glm4_moe" if family != "glm4_moe" else "deepseek_v3"
        import_draft(folder, Target(other, family_model(other), target.tokenizer), tmp_path / "other")


# ------------------------------------------------------------------------------------------ sampling (chi-squared)

def mtp_sampling_pvalue(family: str, samples: int = SAMPLES) -> tuple[float, int]:
    """The chi-squared p-value of the engine's tokens 2 and 3 at T=1, drafted by a fresh MTP layer (two tokens per
    step), against the target's exact joint distribution; and how many verifications refused a draft token."""
    target = Target(family, family_model(family, vocab_size=V), _TinyTokenizer())
    torch.manual_seed(1)
    drafter = build_drafter(mtp_section(init_from_target=[]), target).eval()
    return joint_pvalue(target, build_proposer("eagle", target, draft=drafter), samples)


@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_sampling_with_the_mtp_draft_follows_the_target(family, one_thread):
    pvalue, refused = mtp_sampling_pvalue(family)
    assert refused > SAMPLES // 10  # rollbacks happened
    assert pvalue > P_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_sampler_that_keeps_every_mtp_draft_token_fails(family, monkeypatch, one_thread):
    """The broken rule emits the draft's distribution instead of the target's: the same test must reject it."""
    import drafttrain.decoding.engine as engine

    def accept_everything(tokens, p, q, generator):
        k = tokens.shape[1]
        return torch.tensor(k), int(torch.multinomial(p[0, k], 1, generator=generator))

    monkeypatch.setattr(engine, "verify_chain", accept_everything)
    assert mtp_sampling_pvalue(family, samples=SAMPLES // 2)[0] < BROKEN_THRESHOLD


# ------------------------------------------------------------------------------------------- the command path

@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_import_train_evaluate_export_and_evaluate_the_export(family, native, tmp_path, one_thread):
    """The published layer imported, continued for a few steps from a recipe (prepare, train, the checkpoint
    evaluated by decoding), exported in both formats, and each export evaluated by `drafttrain eval`: greedy output
    the target's throughout."""
    folder, _ = native(family)
    imported = tmp_path / "imported"
    assert main(["import", str(folder), "--target", str(folder), "--out", str(imported)]) == 0
    recipe = small_recipe(tmp_path, {"kind": "mtp", "init_from": str(imported), "steps": 2},
                          target={"model": str(folder)},
                          training={"max_steps": 2, "save_every": 2, "learning_rate": 1e-4, "log_every": 1},
                          eval={"suite": "mt_bench", "num_prompts": 1, "max_new_tokens": 8, "depth": 2})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    measured = json.loads((run / "checkpoints" / "step-000002" / "eval" / "report.json").read_text())
    assert measured["overall"]["greedy_match"] == 1.0 and measured["config"]["draft"]["kind"] == "mtp"
    for fmt in ("vllm", "hf"):
        export = tmp_path / f"export-{fmt}"
        assert main(["export", str(run), "--format", fmt, "--out", str(export)]) == 0
        assert '"method": "mtp"' in (export / "README.md").read_text()
        assert main(["eval", "--target", str(folder), "--draft", str(export), "--num-prompts", "1", "--turns", "1",
                     "--max-new-tokens", "8", "--depth", "2", "--no-progress", "--strict",
                     "--out", str(tmp_path / f"eval-{fmt}")]) == 0
        report = json.loads((tmp_path / f"eval-{fmt}" / "report.json").read_text())
        assert report["overall"]["greedy_match"] == 1.0 and report["config"]["draft"]["kind"] == "mtp"
