"""What rolling the cache back costs per speculative cycle, for one family of each cache kind.

Each family's model (tests/families.py) at a larger size (hidden 256, 8 layers) decodes 128 tokens after a
~300-token prompt with a noised copy of itself as a depth-3 draft model (drafts accepted and refused), 3 times;
the engine times each cycle, its verification and, within it, the cache's rollback (targets.cache).

    python scripts/experiments/families/rollback_cost.py [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from families import ONE_PER_CACHE_KIND, family_model, noised  # noqa: E402

from drafttrain.decoding import SpeculativeDecoder, build_proposer  # noqa: E402
from drafttrain.targets import Target, load_tokenizer  # noqa: E402

LARGER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)
LAYER_TYPES = {"sliding": ["sliding_attention"] * 3 + ["full_attention"], "recurrent":
               ["linear_attention"] * 3 + ["full_attention"], "conv": ["conv", "full_attention", "conv", "full_attention"]}


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
    for kind, family in ONE_PER_CACHE_KIND.items():
        changes = dict(LARGER)
        if kind in LAYER_TYPES:
            changes["layer_types"] = LAYER_TYPES[kind] * 2
        if family == "deepseek_v3":
            changes.update(head_dim=32, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, kv_lora_rank=64,
                           num_key_value_heads=4,  # MLA: as many key-value heads as query heads
                           q_lora_rank=96)
        if kind == "recurrent":
            changes.update(linear_key_head_dim=32, linear_value_head_dim=32)
        target = Target(family, family_model(family, **changes), tokenizer)
        draft = Target(family + "-noised", noised(target.model, 0.05), tokenizer)
        decoder = SpeculativeDecoder(target, build_proposer("draft_model", target, draft=draft), depth=3)
        cycles, verify, rollback, accepted = [], [], [], []
        for _ in range(args.repeats):
            stats = decoder.generate(prompt, 128).stats
            steps = len(stats.cycle_s)
            cycles.append(1e3 * sum(stats.cycle_s) / steps)
            verify.append(1e3 * stats.verify_time_s / steps)
            rollback.append(1e3 * stats.rollback_time_s / steps)
            accepted.append(sum(stats.accepted_per_step) / steps)
        rows[kind] = {"family": family, "cycle_ms": statistics.median(cycles), "verify_ms": statistics.median(verify),
                      "rollback_ms": statistics.median(rollback), "accepted_per_cycle": statistics.median(accepted)}
        r = rows[kind]
        print(f"{kind:10s} {family:12s} cycle {r['cycle_ms']:7.2f} ms  verify {r['verify_ms']:7.2f} ms  rollback "
              f"{r['rollback_ms']:6.2f} ms ({100 * r['rollback_ms'] / r['cycle_ms']:4.1f}% of the cycle)  "
              f"accepted {r['accepted_per_cycle']:.2f}/cycle", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
