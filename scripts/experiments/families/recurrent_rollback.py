"""The rollback of recurrent targets, two ways, in one run: taking the states transformers recorded during the
verification (drafttrain's rollback) against restoring the states copied before it and feeding the kept tokens
again (the rollback before transformers recorded states, forced here by telling each cache its model records none).

Each recurrent family of tests/families.py at a larger size (hidden 256, 8 layers) decodes 128 tokens after a
~300-token prompt with a noised copy of itself as a depth-3 draft model; the two ways alternate, ``--repeats``
times each, and both must give the target's greedy output.

    python scripts/experiments/families/recurrent_rollback.py [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from families import CACHE_KIND, family_model, noised  # noqa: E402

import drafttrain.decoding.engine as engine  # noqa: E402
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode  # noqa: E402
from drafttrain.targets import Target, load_tokenizer  # noqa: E402
from drafttrain.targets import cache as cache_module  # noqa: E402

LARGER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)
SIZES = {"qwen3_next": dict(linear_key_head_dim=32, linear_value_head_dim=32,
                            layer_types=["linear_attention"] * 3 + ["full_attention"]),
         "falcon_h1": dict(mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32)}
SIZES["qwen3_5"] = SIZES["qwen3_5_moe"] = SIZES["qwen3_next"]


class ReplayingCache(cache_module.TargetCache):
    """The rollback as it was: no state recorded, every refused token costs a restore and a replay."""

    def __init__(self, model):
        super().__init__(model)
        self.records = False


@contextlib.contextmanager
def engine_cache(cls):
    """The decoding engine builds its target caches from ``cls`` inside the block."""
    before = engine.TargetCache
    engine.TargetCache = cls
    try:
        yield
    finally:
        engine.TargetCache = before


def decode(target: Target, draft: Target, prompt: list[int], way: str) -> dict:
    with engine_cache(ReplayingCache if way == "replay" else cache_module.TargetCache):
        decoder = SpeculativeDecoder(target, build_proposer("draft_model", target, draft=draft), depth=3)
        out = decoder.generate(prompt, 128)
    stats, steps = out.stats, len(out.stats.cycle_s)
    return {"tokens": out.tokens, "cycle_ms": 1e3 * sum(stats.cycle_s) / steps,
            "verify_ms": 1e3 * stats.verify_time_s / steps, "rollback_ms": 1e3 * stats.rollback_time_s / steps,
            "accepted_per_cycle": sum(stats.accepted_per_step) / steps}


def measure(family: str, prompt: list[int], tokenizer, repeats: int) -> dict:
    changes = {**LARGER, **SIZES.get(family, {})}
    if "layer_types" in changes:
        changes["layer_types"] = changes["layer_types"] * (changes["num_hidden_layers"] // 4)
    target = Target(family, family_model(family, **changes), tokenizer)
    draft = Target(family + "-noised", noised(target.model, 0.05), tokenizer)
    greedy = plain_decode(target, prompt, 128).tokens
    runs = {"recorded": [], "replay": []}
    for _ in range(repeats):
        for way in runs:  # interleaved: both ways see the same machine
            run = decode(target, draft, prompt, way)
            assert run.pop("tokens") == greedy, f"{family} {way}: not the target's greedy output"
            runs[way].append(run)
    return {way: {key: statistics.median(r[key] for r in found) for key in found[0]} for way, found in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    text = (REPO / "README.md").read_text()[:1200]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    rows = {}
    for family in [name for name, kind in CACHE_KIND.items() if kind == "recurrent"]:
        rows[family] = measure(family, prompt, tokenizer, args.repeats)
        for way, r in rows[family].items():
            print(f"{family:12s} {way:8s} cycle {r['cycle_ms']:7.2f} ms  verify {r['verify_ms']:7.2f} ms  rollback "
                  f"{r['rollback_ms']:6.2f} ms ({100 * r['rollback_ms'] / r['cycle_ms']:4.1f}%)  accepted "
                  f"{r['accepted_per_cycle']:.2f}/cycle", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
