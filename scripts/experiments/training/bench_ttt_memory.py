"""the memory benchmark: peak memory and time of one EAGLE-3 training step (training-time test 3 and 7) on
SmolLM2-135M-Instruct at rows of 512, 2k, 4k and 8k tokens, for two checkouts of drafttrain (before/after a change),
each beside what that checkout's `drafttrain plan` predicts.

    python scripts/experiments/training/bench_ttt_memory.py --before BEFORE_CHECKOUT [--lengths 512 2048 4096 8192] [--out runs/bench_ttt]
    python scripts/experiments/training/bench_ttt_memory.py --before BEFORE_CHECKOUT --recipe recipes/smollm2_peagle.yaml --ttt 1   # P-EAGLE

The recipe is the longer EAGLE-3 recipe (8k draft vocabulary, initialised from the target), or ``--recipe``'s (the
P-EAGLE recipe: its mask slots in place of the unrolled steps, ``--ttt`` then unused), with one row per step of the
given length. Every case runs in its own process (peak resident memory = the process's ``ru_maxrss``): it
loads the target, runs it over one row of random ids, then times 3 draft steps (forward, backward, AdamW step)
after one warm-up step. The two checkouts alternate case by case, so machine noise falls on both. A case that
exceeds the address-space limit (``--limit-gib``) is reported as not fitting instead of swapping the machine.
Results: OUT/ttt_memory.json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "recipes/smollm2_eagle3.yaml"
REPO = Path(__file__).resolve().parents[3]


def settings(length: int, ttt: int, out: Path) -> list[str]:
    """The recipe's settings for one case (draft.ttt_steps is unused by a P-EAGLE head)."""
    return [f"output_dir={out}", f"data.max_length={length}", "training.batch_size=1", f"draft.ttt_steps={ttt}",
            "wandb.mode=disabled"]


def measure(length: int, ttt: int, out: str, steps: int, recipe_path: str = RECIPE) -> dict:
    """In the child: one row of ``length`` random ids through the target, then timed draft steps."""
    import torch  # in the child, from the checkout under test (its PYTHONPATH), not the caller's

    from drafttrain.config import load_recipe
    from drafttrain.drafts import drafter_class
    from drafttrain.targets import run_target
    from drafttrain.targets.loading import load_target
    from drafttrain.training.footprint import _draft_section

    torch.manual_seed(0)
    recipe = load_recipe(REPO / recipe_path, settings(length, ttt, Path(out)))
    target = load_target(recipe.target)
    with _draft_section(recipe, target.vocab_size) as (section, run):
        draft = drafter_class(section.kind).build(section, target, run).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, target.vocab_size, (1, length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(1, length)}
    with torch.no_grad():
        outputs = run_target(target, batch, draft.needs())
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        draft.training_step(batch, outputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_mib": peak / 2**20, "step_s": sorted(times)[len(times) // 2], "steps_s": times}


def child(checkout: Path, length: int, ttt: int, out: Path, steps: int, limit_gib: float, recipe: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "WANDB_MODE": "disabled"}
    limit = int(limit_gib * 2**30)
    code = ("import json, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (%d, %d)); "
            "sys.path.insert(0, %r); import bench_ttt_memory as b; "
            "print('RESULT', json.dumps(b.measure(%d, %d, %r, %d, %r)))"
            % (limit, limit, str(REPO / "scripts"), length, ttt, str(out), steps, recipe))
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"error": tail[0][:300]}


def planned(checkout: Path, length: int, ttt: int, out: Path, recipe: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "drafttrain", "plan", str(REPO / recipe), *settings(length, ttt, out), "--json"]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    try:  # a plan that does not fit this machine exits 1 with its figures on stdout all the same
        return json.loads(done.stdout)["total"] / 2**20
    except (json.JSONDecodeError, KeyError):
        raise SystemExit(f"plan failed in {checkout}:\n{done.stderr[-2000:]}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of drafttrain before the change")
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--ttt", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recipe", default=RECIPE, help="relative to the repository (default: %(default)s)")
    parser.add_argument("--limit-gib", type=float, default=21.0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_ttt"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for ttt in args.ttt:
        for length in args.lengths:
            for side, checkout in (("before", args.before), ("after", args.after)):
                row = {"side": side, "length": length, "ttt": ttt, "recipe": args.recipe,
                       "plan_mib": planned(checkout, length, ttt, args.out, args.recipe),
                       **child(checkout, length, ttt, args.out, args.steps, args.limit_gib, args.recipe)}
                results.append(row)
                (args.out / "ttt_memory.json").write_text(json.dumps(results, indent=1))
                print(json.dumps(row), flush=True)
    print(table(results))
    return 0


def table(results: list[dict]) -> str:
    lines = ["| TTT | L | peak before | peak after | plan after / peak | step before | step after |",
             "|---|---|---|---|---|---|---|"]
    pairs = {}
    for r in results:
        pairs.setdefault((r["ttt"], r["length"]), {})[r["side"]] = r
    for (ttt, length), pair in pairs.items():
        b, a = pair.get("before", {}), pair.get("after", {})
        peak = lambda r: f"{r['peak_mib']:.0f} MiB" if "peak_mib" in r else "did not fit"  # noqa: E731
        step = lambda r: f"{r['step_s']:.2f} s" if "step_s" in r else "-"  # noqa: E731
        ratio = f"{a['plan_mib'] / a['peak_mib']:.2f}" if "peak_mib" in a else "-"
        lines.append(f"| {ttt} | {length} | {peak(b)} | {peak(a)} | {ratio} | {step(b)} | {step(a)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
