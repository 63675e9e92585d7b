"""the ablation: each "start from the target" / data lever alone, then the kept combination, each trained
for the same wall-clock budget on the quickstart's data, then measured on MT-Bench first turns (T=0) against plain
decoding in the same run.

    python scripts/experiments/levers/ablate_levers.py [--minutes 4] [--num-prompts 8] [--only NAME ...] [--out runs/ablation]

Each variant is the quick recipe (recipes/smollm2_eagle3_quick.yaml) with every lever off, plus its overrides, in
its own run folder;
``prepare`` reuses the regenerated answers from the answer store. Results: OUT/ablation.json and a Markdown table
on stdout (held-out top-1 accuracy at position 1, simulated τ, measured τ, speedup, training tokens/s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "recipes/smollm2_eagle3_quick.yaml"
# the quick recipe with every lever off (the recipe itself now has the kept ones on)
LEVERS_OFF = ["draft.ttt_steps=5", "draft.init_from_target=[]", "draft.noise=0.0", "eval.depth=5"]
KEPT = ["draft.init_from_target=[lm_head,layer,fc]", "draft.noise=0.1", "draft.ttt_steps=3"]
VARIANTS: dict[str, list[str]] = {
    "baseline (from noise)": [],
    "lm_head from target": ["draft.init_from_target=[lm_head]"],
    "layer from target": ["draft.init_from_target=[layer]"],
    "fc pass-through": ["draft.init_from_target=[fc]"],
    "tap noise 0.1 (±0.05)": ["draft.noise=0.1"],
    "TTT 3 steps": ["draft.ttt_steps=3"],
    "all three inits + noise": ["draft.init_from_target=[lm_head,layer,fc]", "draft.noise=0.1"],
    "kept: three inits + noise + TTT 3": KEPT,
    # the data levers, each on top of the kept combination
    "kept + offline feature cache": [*KEPT, "training.hidden_states=offline"],
    "kept + draft vocab by coverage 0.95": [*KEPT, "draft_vocab.coverage=0.95"],
}


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def last_metrics(run_dir: Path) -> dict:
    train, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        (evals if any(k.startswith("eval/") for k in record) else train).update(record)
    return {"train": train, "eval": evals}


def _f(value, digits=2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--out", default="runs/ablation")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "ablation.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for index, (name, overrides) in enumerate(VARIANTS.items()):
        if args.only and name not in args.only or name in results:
            continue
        folder = out / f"v{index}"
        common = [f"output_dir={folder}", f"training.time_budget_minutes={args.minutes}", "training.epochs=50",
                  "training.save_every=100000", "eval.num_prompts=2", "wandb.mode=disabled", *LEVERS_OFF,
                  *overrides]
        started = time.perf_counter()
        run(["drafttrain", "prepare", RECIPE, *common, "--no-progress"])
        prepare_s = time.perf_counter() - started  # the offline cache is written here, outside the budget
        run(["drafttrain", "train", RECIPE, *common])
        run(["drafttrain", "eval", "--target", "smollm2-135m-instruct", "--draft", str(folder), "--suite", "mt_bench",
             "--num-prompts", str(args.num_prompts), "--turns", "1", "--max-new-tokens", str(args.max_new_tokens),
             "--depth", str(args.depth), "--out", str(folder / "eval")])
        report = json.loads((folder / "eval" / "report.json").read_text())["overall"]
        logged = last_metrics(folder)
        results[name] = {"overrides": overrides, "steps": logged["train"].get("step"), "prepare_s": prepare_s,
                         "train_acc_0": logged["train"].get("acc_0"),
                         "tokens_per_s": logged["train"].get("tokens_per_s"),
                         "val_acc_0": logged["eval"].get("eval/val_acc_0"), "sim_tau": logged["eval"].get("eval/sim_tau"),
                         "tau": report["tau"], "speedup": report["speedup"],
                         "acceptance_cond": report["acceptance_per_position"]["conditional"]}
        results_path.write_text(json.dumps(results, indent=1))
        print(f"{name}: {results[name]}", flush=True)
    print(f"\n| variant | prepare s | steps in {args.minutes:g} min | train tok/s | held-out acc@1 | sim τ | "
          "τ (MT-Bench) | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {_f(r.get('prepare_s'), 0)} | {r['steps']} | {r['tokens_per_s']:.0f} | "
              f"{_f(r['val_acc_0'], 3)} | {_f(r['sim_tau'])} | {r['tau']:.2f} | {r['speedup']:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
