"""Speculative decoding: the loop (engine), lossless verification rules (verify), draft proposers, tree shapes.

    from drafttrain.decoding import SpeculativeDecoder, build_proposer, DynamicTree
    dec = SpeculativeDecoder(target, build_proposer("prompt_lookup", target), depth=5)
    out = dec.generate(prompt_ids, max_new_tokens=128, stop_token_ids={target.tokenizer.eos_token_id})
    out.tokens, out.stats.accepted_per_step
"""

from drafttrain.decoding.engine import DecodeOutput, DecodeStats, SpeculativeDecoder, plain_decode
from drafttrain.decoding.proposers import (
    PROPOSERS,
    DraftModelProposer,
    DraftRequest,
    NoDraft,
    PromptLookupProposer,
    Proposer,
    build_proposer,
    register_proposer,
)
from drafttrain.decoding.trees import Chain, Draft, DynamicTree, StaticTree
from drafttrain.decoding.verify import Sampling, expected_acceptance_rate
from drafttrain.decoding import eagle as _eagle  # noqa: F401,E402  (registers the eagle3 / eagle proposers)

__all__ = [
    "PROPOSERS",
    "Chain",
    "DecodeOutput",
    "DecodeStats",
    "Draft",
    "DraftModelProposer",
    "DraftRequest",
    "DynamicTree",
    "NoDraft",
    "PromptLookupProposer",
    "Proposer",
    "Sampling",
    "SpeculativeDecoder",
    "StaticTree",
    "build_proposer",
    "expected_acceptance_rate",
    "plain_decode",
    "register_proposer",
]
