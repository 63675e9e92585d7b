"""Proof in a real client: load an EAGLE-3, P-EAGLE or DFlash draft's speculators-format export with speculators'
own classes (in their own venv) and compare its drafting forward with drafttrain's on the same target hidden states.

    python scripts/tools/check_speculators_load.py RUN_OR_CHECKPOINT [--speculators-python .venvs/speculators/bin/python]
        [--num-prompts 4] [--max-new-tokens 64] [--out DIR]

For each prompt the target's greedy answer is generated, the target's tapped hidden states are taken over prompt +
answer, and both sides predict from them: EAGLE-3's first step at every position (the hidden state at t and the
token t+1 give token t+2), DFlash's block at every answer position (speculators' own forward, given our anchors).
It prints how many of speculators' draft tokens equal ours, the largest logit difference, and whether speculators
loaded the token embeddings (an export without them loads as all zeros).
Exit 0 when every draft token agrees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.decoding import plain_decode
from drafttrain.drafts import load_drafter
from drafttrain.drafts.base import read_draft_config
from drafttrain.drafts.layers import shift_left
from drafttrain.drafts.peagle import Rollouts
from drafttrain.evaluation.suites import load_suite
from drafttrain.export import export_draft
from drafttrain.runfolder import find_draft
from drafttrain.targets import HiddenStateTap, load_target

WORKER = Path(__file__).with_name("serving") / "speculators_worker.py"


def taps_of(drafter, target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), HiddenStateTap(target.model, drafter.tap_layers) as tap:
        target.model(input_ids=ids, use_cache=False)
        return tap.stacked()


def eagle3_inputs(drafter, target, ids: torch.Tensor, start: int) -> tuple[dict, torch.Tensor, int]:
    """EAGLE-3's first step at every position: (the worker's inputs, our draft-vocabulary logits [T', V'], how many
    positions count: the last has no next token fed)."""
    taps, fed = taps_of(drafter, target, ids), shift_left(ids, 1)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        _, target_logits = drafter.step(drafter.fuse(taps), fed, positions, drafter.new_caches())
        logits = target_logits[0][:, drafter.draft_to_target]  # back to the draft vocabulary, as speculators drafts
    return {"hidden": taps.float(), "input_ids": fed}, logits, ids.shape[1] - 1


def dflash_inputs(drafter, target, ids: torch.Tensor, start: int) -> tuple[dict, torch.Tensor, int]:
    """A block anchored at every answer position whose block fits: (inputs, our logits [A*W, V'], all count)."""
    taps = taps_of(drafter, target, ids)
    anchors = torch.arange(start, ids.shape[1] - drafter.block_size)
    with torch.no_grad():
        logits = drafter.block_logits_at(taps, ids, anchors.unsqueeze(0))[0].flatten(0, 1)
    return {"hidden": taps.float(), "input_ids": ids, "anchors": anchors}, logits, logits.shape[0]


def peagle_inputs(drafter, target, ids: torch.Tensor, start: int) -> tuple[dict, torch.Tensor, int]:
    """Every real pair, and a whole rollout of mask slots from every fourth answer position: (inputs, our logits over
    them, all count)."""
    taps = taps_of(drafter, target, ids)
    t, depths = ids.shape[1], drafter.config.parallel.depths
    anchors = [a for a in range(start, t - depths - 1, 4) for _ in range(1, depths)]
    levels = [d for _ in range(start, t - depths - 1, 4) for d in range(1, depths)]
    rollouts = Rollouts(torch.tensor(anchors), torch.tensor(levels))
    with torch.no_grad():
        logits = drafter._parallel_logits(taps[0], ids[0], rollouts)[0]
    slots = torch.stack([torch.cat([torch.arange(t), rollouts.anchors]),
                         torch.cat([torch.zeros(t, dtype=torch.long), rollouts.depths])])
    return {"hidden": taps.float(), "input_ids": shift_left(ids, 1), "slots": slots}, logits, logits.shape[0]


INPUTS = {"eagle3": eagle3_inputs, "dflash": dflash_inputs, "peagle": peagle_inputs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft")
    parser.add_argument("--speculators-python", default=".venvs/speculators/bin/python")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/speculators_check")
    args = parser.parse_args()

    checkpoint = find_draft(args.draft)
    target = load_target(read_draft_config(checkpoint)["drafttrain"]["target"]["name"])
    drafter = load_drafter(checkpoint, target).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    export = export_draft(checkpoint, "speculators", out / "export", target, overwrite=True,
                          verifier=str(target.source_dir))
    stops = set(stop_token_ids(target.tokenizer, target.model.generation_config))
    kind = json.loads((export / "config.json").read_text())["speculators_model_type"]  # the class speculators picks
    agree = total = 0
    worst = 0.0
    loaded = {}
    for i, question in enumerate(load_suite("mt_bench").select(args.num_prompts, turns="1").questions):
        prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": question.turns[0]}])
        answer = plain_decode(target, torch.tensor([prompt]), args.max_new_tokens, stop_token_ids=stops).tokens
        ids = torch.tensor([prompt + answer])
        inputs, logits, valid = INPUTS[kind](drafter, target, ids, len(prompt))
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(out / f"inputs-{i}.safetensors"))
        job = out / f"job-{i}.json"
        job.write_text(json.dumps({"kind": kind, "draft": str(export.resolve()),
                                   "inputs": str(out / f"inputs-{i}.safetensors")}))
        done = subprocess.run([args.speculators_python, str(WORKER), str(job), str(out / f"theirs-{i}.safetensors")],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"speculators failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        theirs = load_file(str(out / f"theirs-{i}.safetensors"))
        loaded = {"embed_zero": bool(theirs["embed_zero"].item()), "embed_nan": bool(theirs["embed_nan"].item())}
        mine = logits[:valid].argmax(-1)
        agree += int((mine == theirs["draft_tokens"].reshape(-1)[:valid]).sum())
        total += valid
        worst = max(worst, float((logits[:valid] - theirs["logits"].reshape(-1, logits.shape[-1])[:valid]).abs().max()))
    result = {"draft": str(checkpoint), "positions": total, "draft_tokens_equal": agree,
              "max_logit_difference": worst, **loaded}
    (out / "speculators_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if agree == total and not loaded.get("embed_zero") else 1


if __name__ == "__main__":
    sys.exit(main())
