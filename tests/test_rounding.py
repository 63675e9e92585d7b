"""A greedy mismatch judged by the target: its own rounding (a near-tie in bf16) or a defect of ours."""

from __future__ import annotations

import pytest
import torch

from drafttrain.decoding import engine
from drafttrain.evaluation import evaluate, load_suite
from drafttrain.evaluation.report import mismatch_text, render_markdown
from drafttrain.evaluation.rounding import mismatch_rounding
from drafttrain.evaluation.sides import Compared
from drafttrain.targets import load_target

CONTEXT = "The capital of France is Paris. The capital of Germany is"


def _ranked(target, text: str) -> tuple[list[int], list[int]]:
    ids = target.tokenizer(text)["input_ids"]
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0, -1]
    return ids, logits.topk(2).indices.tolist()


def test_the_runner_up_is_no_rounding_in_float32_and_bf16_rounds_far_more(smollm2):
    ids, (first, second) = _ranked(smollm2, CONTEXT)
    fp32 = mismatch_rounding(smollm2, ids, expected=first, got=second)
    assert not fp32["rounding"] and fp32["logit_gap_step"] > 1.0  # a clear gap: a defect, were it emitted
    assert fp32["rounding_noise"] < 1e-3
    assert mismatch_rounding(smollm2, ids, expected=first, got=first)["rounding"]  # a tie is within any noise
    bf16_target = load_target("smollm2-135m-instruct", dtype="bfloat16")
    bf16 = mismatch_rounding(bf16_target, ids, expected=first, got=second)
    assert next(bf16_target.model.parameters()).dtype == torch.bfloat16
    bf16_rounds_apart = bf16["rounding_noise"] > 100 * max(fp32["rounding_noise"], 1e-7)  # one-token vs 8-wide
    if _bf16_rows_depend_on_each_other(bf16_target):  # MKL's bf16 kernels (AVX2, AVX-512 without AMX), a GPU's
        assert bf16_rounds_apart
    else:  # every linear layer computes each row alone (oneDNN on AMX; an AMD EPYC with AVX-512 BF16): the two ways
        # agree bit for bit, and the check says so, or they part only in attention, where transformers runs one
        # query with its GQA heads packed and no mask and eight with the heads repeated and a mask; those kernels
        # round apart only on some values (on the EPYC: 0.1875 here, from layer 2 of 30, and never on random
        # tensors), so no probe of ours can tell in advance
        assert bf16["rounding_noise"] == 0.0 or bf16_rounds_apart
    assert not bf16["rounding"]  # the runner-up's clear gap is no rounding in bf16 either


def _bf16_rows_depend_on_each_other(target) -> bool:
    """Whether this machine's bf16 matrix products round a row differently when others are computed with it, in
    any of the target's own linear layers: the source of one-token vs verification-wide noise. Measured, since it
    is a fact of the CPU's kernels, which are chosen by shape: on an AVX-512 Xeon without native bf16 SmolLM2's
    lm_head rounds rows together and its MLP's layers do not."""
    torch.manual_seed(0)
    layers = {m.weight.shape: m for m in target.model.modules() if isinstance(m, torch.nn.Linear)}
    with torch.inference_mode():
        for layer in layers.values():
            x = torch.randn(1, 8, layer.in_features, dtype=torch.bfloat16)
            if not torch.equal(layer(x)[:, -1:], layer(x[:, -1:])):
                return True
    return False


def _accept_every_draft(draft: torch.Tensor, target_tokens: torch.Tensor):
    """A lossy greedy rule: every drafted token accepted, whatever the target says."""
    k = draft.shape[1]
    return torch.full((draft.shape[0],), k, dtype=torch.long), target_tokens[:, k]


@pytest.mark.slow
def test_a_lossy_acceptance_rule_is_reported_as_no_rounding(smollm2, monkeypatch, restore_threads):
    torch.set_num_threads(1)
    questions = load_suite("gsm8k").select(2)
    honest = evaluate(smollm2, "prompt_lookup", questions, depth=3, max_new_tokens=32, progress=False,
                      compare=[Compared("prompt_lookup", depth=2, label="lookup@2")])
    assert honest.greedy_match == 1.0 and honest.overall["greedy_mismatches"] == {"prompts": 0, "rounding": 0}
    assert mismatch_text(honest) is None
    monkeypatch.setattr(engine, "verify_chain_greedy", _accept_every_draft)
    lossy = evaluate(smollm2, "prompt_lookup", questions, depth=3, max_new_tokens=32, progress=False,
                     compare=[Compared("prompt_lookup", depth=2, label="lookup@2")])
    judged = [r["mismatch_rounding"] for r in lossy.prompts if r["mismatch_rounding"]]
    assert judged and lossy.overall["greedy_mismatches"]["prompts"] == len(judged)
    assert lossy.overall["greedy_mismatches"]["rounding"] < len(judged)
    assert any(not v["rounding"] and v["logit_gap_step"] > 1.0 for v in judged)
    line = lossy.comparisons["lookup@2"]
    assert line["mismatches"] and all(m["question_id"] for m in line["mismatches"])
    assert "NOT explained by rounding" in render_markdown(lossy)
