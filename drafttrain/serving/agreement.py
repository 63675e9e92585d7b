"""The engine's acceptance at one stream and T=0 against drafttrain's own evaluator on the same prompts.

Both draft by argmax and verify greedily, so on the same prompt ids, stop tokens and budget they make the same
drafts and accept the same tokens; only a near-tie that the engine's kernels break the other way (a different
answer from there on) separates them. A difference beyond ``agreement_tolerance`` is an error in the report.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from drafttrain.config import DecodeSettings
from drafttrain.cpu_linear import PackedLinears
from drafttrain.decoding import SpeculativeDecoder
from drafttrain.decoding.proposers import build_proposer
from drafttrain.progress import progress_bar
from drafttrain.targets import Target


def drafttrain_side(target: Target, drafter, ids: list[list[int]], count: int, length: int, max_new_tokens: int,
                    stop_ids: list[int]) -> dict[str, Any]:
    """τ (1 + accepted draft tokens per verification step, the engine's definition) of ``drafter`` at chain depth
    ``length`` on the first ``count`` prompts (cycled as the load generator sends them), with the answers' text."""
    proposer = build_proposer(drafter.proposer, target, draft=drafter)
    decoder = SpeculativeDecoder(target, proposer, DecodeSettings.of(depth=length, temperature=0.0))
    steps = accepted = 0
    texts = []
    prompts = list(itertools.islice(itertools.cycle(ids), count))
    # the kernels drafttrain eval decodes with on a CPU (pre-packed oneDNN weights), so this is its τ
    with PackedLinears(target.model, *proposer.modules()):
        for prompt in progress_bar(prompts, f"drafttrain τ, k={length}", "prompt"):
            out = decoder.generate(torch.tensor([prompt]), max_new_tokens, stop_token_ids=set(stop_ids))
            steps += len(out.stats.accepted_per_step)
            accepted += sum(out.stats.accepted_per_step)
            texts.append(target.tokenizer.decode([t for t in out.tokens if t not in stop_ids],
                                                 skip_special_tokens=True))
    return {"tau": 1 + accepted / steps if steps else None, "steps": steps, "accepted": accepted, "texts": texts}


def compare(label: str, engine_level: dict[str, Any] | None, ours: dict[str, Any], tolerance: float) \
        -> tuple[dict[str, Any], str | None]:
    """The agreement row for one side, and the error when the two τ differ by more than ``tolerance``."""
    engine_tau = (engine_level or {}).get("acceptance_length")
    texts = (engine_level or {}).get("generated_texts") or []
    same = sum(a == b for a, b in zip(texts, ours["texts"]))
    row = {"side": label, "engine_tau": engine_tau, "drafttrain_tau": ours["tau"], "tolerance": tolerance,
           "difference": None if engine_tau is None or ours["tau"] is None else engine_tau - ours["tau"],
           # per pass: the passes of one level send the same prompts, and our evaluator decodes them once
           "engine_steps": None if engine_level is None or engine_level.get("verify_steps") is None
           else engine_level["verify_steps"] / engine_level.get("passes", 1), "drafttrain_steps": ours["steps"],
           "outputs_equal": f"{same}/{len(ours['texts'])}" if texts else None}
    if row["difference"] is None:
        return row, f"{label}: no τ to compare at concurrency 1 (engine {engine_tau}, drafttrain {ours['tau']})"
    if abs(row["difference"]) > tolerance:
        return row, (f"{label}: the engine's acceptance length at concurrency 1 ({engine_tau:.3f}) differs from "
                     f"drafttrain eval's τ ({ours['tau']:.3f}) by more than {tolerance}")
    return row, None
