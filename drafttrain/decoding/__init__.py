"""Speculative decoding: the loop (engine), lossless verification rules (verify), draft shapes (trees), and the
proposers (prompt lookup, lookahead, draft model, EAGLE heads), registered by name.

    from drafttrain.decoding import SpeculativeDecoder, build_proposer, DynamicTree
    dec = SpeculativeDecoder(target, build_proposer("prompt_lookup", target), depth=5)
    out = dec.generate(prompt_ids, max_new_tokens=128, stop_token_ids={target.tokenizer.eos_token_id})
    out.tokens, out.stats.accepted_per_step
"""

# importing a proposer module registers it by name
from drafttrain.decoding.block import BlockProposer
from drafttrain.decoding.draft_model import DraftModelProposer
from drafttrain.decoding.eagle import EagleProposer
from drafttrain.decoding.engine import DecodeOutput, DecodeStats, SpeculativeDecoder, plain_decode
from drafttrain.decoding.lookahead import LookaheadProposer
from drafttrain.decoding.medusa import MedusaProposer
from drafttrain.decoding.pard import PardProposer
from drafttrain.decoding.peagle import PEagleProposer
from drafttrain.decoding.proposers import (
    PROPOSERS,
    DraftRequest,
    NoDraft,
    PromptLookupProposer,
    Proposer,
    build_proposer,
    register_proposer,
)
from drafttrain.decoding.trees import Chain, Draft, DynamicTree, StaticTree
from drafttrain.decoding.verify import expected_acceptance_rate
from drafttrain.sampling import Sampling

__all__ = [
    "PROPOSERS",
    "BlockProposer",
    "Chain",
    "DecodeOutput",
    "DecodeStats",
    "Draft",
    "DraftModelProposer",
    "DraftRequest",
    "DynamicTree",
    "EagleProposer",
    "LookaheadProposer",
    "MedusaProposer",
    "PEagleProposer",
    "PardProposer",
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
