"""Is a greedy mismatch the target's own rounding, or a defect? The check behind every report's mismatch note.

At T=0 a speculative side must emit the target's greedy tokens. It verifies k+1 tokens in one forward where plain
decoding runs k+1 one-token forwards; in float32 the two agree, but in bf16 (a GPU's usual dtype) their matrix
products round differently, and where the target's two best tokens are nearly tied the argmax can go either way
(the 2026-11-27 H200 check: prompt lookup, which has no draft model, matched 0 of 4 prompts). A defect of ours
(a wrong mask, position or acceptance rule) instead emits a token the target ranks clearly lower.

So at a mismatch the target runs the shared context both ways from one prefill: ending in a one-token forward (as
plain decoding's step does) and in a verification-wide one (as a speculative step does). The difference between
the two computations at the two tokens is the rounding noise there; a mismatch whose logit gap is within twice
that noise, or whose order the two computations disagree on, is rounding.
"""

from __future__ import annotations

import torch

from drafttrain.evaluation.records import SideRun, first_mismatch
from drafttrain.targets import Target, TargetCache

WINDOW = 8  # tokens verified together in the wide computation (a chain of depth 7 verifies 8)


@torch.inference_mode()
def _both_ways(model, ids: torch.Tensor, wide: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float logits [V] for the token after ``ids`` [1, n], from one prefill of all but the last ``wide`` tokens:
    (those tokens then in one forward, as a verification computes it; then, the cache cropped back, all but the
    last of them in one forward and the last alone, as plain decoding's step ends)."""
    prefix = ids.shape[1] - wide
    cache = TargetCache(model)
    if prefix:
        cache.forward(ids[:, :prefix])
    verified = cache.forward(ids[:, prefix:])[0, -1].float()
    cache.keep(prefix, [])  # back to the prefill (an empty cache when there was none)
    if wide > 1:
        cache.forward(ids[:, prefix:-1])
    return cache.forward(ids[:, -1:])[0, -1].float(), verified


def mismatch_rounding(target: Target, context: list[int], expected: int, got: int) -> dict:
    """The target's verdict on a greedy mismatch after ``context`` (prompt and the tokens both sides agreed on):
    ``expected`` is the baseline's token, ``got`` the side's. Returns the logit gap (expected minus got) by each
    computation, the rounding noise at those two tokens, and whether the mismatch is within it."""
    ids = torch.tensor([context], dtype=torch.long, device=target.device)
    step, wide = _both_ways(target.model, ids, min(WINDOW, len(context)))
    gaps = [float(logits[expected] - logits[got]) for logits in (step, wide)]
    noise = max(abs(float(step[t] - wide[t])) for t in (expected, got))
    rounding = (gaps[0] > 0) != (gaps[1] > 0) or min(abs(g) for g in gaps) <= 2 * noise
    return {"logit_gap_step": round(gaps[0], 6), "logit_gap_wide": round(gaps[1], 6),
            "rounding_noise": round(noise, 6), "rounding": bool(rounding)}


def explain_mismatch(target: Target, side: SideRun, base: SideRun) -> dict | None:
    """The first turn where ``side``'s greedy tokens left the baseline's, and the target's verdict there (later
    turns follow from it: each side's history is its own answers). None when the two runs are equal."""
    for turn, (ours, theirs) in enumerate(zip(side.turn_tokens, base.turn_tokens)):
        at = first_mismatch(ours, theirs)
        if at is None:
            continue
        where = {"turn": turn, "at": at}
        if at >= min(len(ours), len(theirs)):
            return {**where, "rounding": None}  # one side stopped: no pair of tokens to compare
        context = base.prompt_ids[turn] + theirs[:at]
        return {**where, **mismatch_rounding(target, context, expected=theirs[at], got=ours[at])}
    return None


def rounding_summary(verdicts: list[dict]) -> dict:
    """How many mismatching prompts there are, and how many of them are the target's rounding."""
    return {"prompts": len(verdicts), "rounding": sum(bool(v["rounding"]) for v in verdicts)}
