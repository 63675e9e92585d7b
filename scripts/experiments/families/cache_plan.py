"""What `drafttrain plan` counts for a target's cache, by cache kind (targets/cache_kinds.py: cache_bytes), against
what transformers' own cache holds, and against the count the plan used before cache kinds (every layer's keys and
values at every position, from num_key_value_heads x head_dim).

Measured: each published config of tests/published_configs at its tiny size, and the two real built-in targets
(SmolLM2-135M, Gemma 3 270M), after one prompt of ``--tokens`` tokens: the bytes their DynamicCache holds. Counted
only (no memory): each published config at its full size, on the meta device, at ``--long`` tokens in bfloat16.

    python scripts/experiments/families/cache_plan.py [--tokens 512] [--long 32768] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from families import PUBLISHED_CACHE_KIND, published_model, published_model_on_meta  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from drafttrain.targets import load_target  # noqa: E402
from drafttrain.targets.cache_kinds import cache_bytes  # noqa: E402
from drafttrain.targets.family import text_config  # noqa: E402

MIB = 2**20


def held(model, tokens: int) -> int:
    """The bytes transformers' cache holds after a prompt of ``tokens`` tokens."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(1, tokens + 1)[None] % 100 + 1, past_key_values=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        tensors += [t for name in ("conv_states", "recurrent_states") for t in (getattr(layer, name, None) or {}).values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def counted(model, tokens: int, itemsize: int) -> int:
    return sum(p + s for _, p, s in cache_bytes(model, tokens, itemsize))


def every_position(model, tokens: int, itemsize: int) -> int:
    """The count before cache kinds: every layer's keys and values of every position."""
    config = text_config(model.config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * tokens * itemsize


def kinds(model, tokens: int) -> str:
    names = [kind for kind, _, _ in cache_bytes(model, tokens, 1)]
    return ", ".join(f"{names.count(k)} {k}" for k in dict.fromkeys(names))


def measured_rows(tokens: int) -> list[dict]:
    rows = []
    models = {name: published_model(name) for name in PUBLISHED_CACHE_KIND}
    for builtin in ("smollm2-135m-instruct", "gemma3-270m"):
        models[builtin] = load_target(builtin).model
    for name, model in models.items():
        itemsize = next(model.parameters()).element_size()
        rows.append({"model": name, "layers": kinds(model, tokens), "held": held(model, tokens),
                     "plan": counted(model, tokens, itemsize), "before": every_position(model, tokens, itemsize)})
    return rows


def full_size_rows(tokens: int) -> list[dict]:
    rows = []
    for name in PUBLISHED_CACHE_KIND:
        model = published_model_on_meta(name)
        rows.append({"model": name, "layers": kinds(model, tokens), "plan": counted(model, tokens, 2),
                     "before": every_position(model, tokens, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--long", type=int, default=32768)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    measured, full = measured_rows(args.tokens), full_size_rows(args.long)
    print(f"| model (tiny, or real) | layers | held after {args.tokens} tokens | plan | plan / held | before / held |")
    print("|---|---|---|---|---|---|")
    for r in measured:
        print(f"| {r['model']} | {r['layers']} | {r['held']:,} B | {r['plan']:,} B | {r['plan'] / r['held']:.3f} | "
              f"{r['before'] / r['held']:.2f} |")
    print(f"\n| published model (full size) | plan, one {args.long}-token sequence, bf16 | before | before / plan |")
    print("|---|---|---|---|")
    for r in full:
        ratio = r["before"] / r["plan"] if r["plan"] else math.inf
        print(f"| {r['model']} | {r['plan'] / MIB:,.0f} MiB | {r['before'] / MIB:,.0f} MiB | {ratio:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "long": args.long, "measured": measured,
                                         "full_size": full}, indent=2))


if __name__ == "__main__":
    main()
