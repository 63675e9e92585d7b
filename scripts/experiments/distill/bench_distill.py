"""the benchmark: distilled draft models on SmolLM2-135M-Instruct at one data set and one wall-clock budget.

    python scripts/experiments/distill/bench_distill.py [--minutes 4] [--threads 1] [--num-prompts 16] [--out runs/bench_distill]
        [--arms sft fkl ...] [--set KEY=VALUE ...] [--set-students KEY=VALUE ...] [--side-by-side]

Arms, each trained for the same budget on the data of recipes/smollm2_distill.yaml (the longer EAGLE-3 recipe's):
the cut student before training, plain SFT on the target's answers, KD with each divergence (FKL, RKL, JSD, TVD)
without and with on-policy data (λ = 0.5), an EAGLE-3 head (the quick recipe's kept levers), and two other student
sizes. Then one ``drafttrain eval`` run per temperature (T=0 and T=0.7) measures every arm on the same MT-Bench
first turns, against plain decoding and HF assisted generation with the FKL student (``--hf-reference``), each arm
with its own depth chosen by ``@auto``. After training, each arm's last checkpoint is also measured on the run's
held-out rows: β = 1 - TVD (the acceptance speculative sampling pays for, no timing) and top-1 agreement with the
target. Results: OUT/bench.json and Markdown tables on stdout.

``--set`` overrides every arm's recipe (e.g. ``data.num_samples=600``), ``--set-students`` the draft-model arms'
only (e.g. ``draft.loss_vocab=draft``); ``--side-by-side`` trains two arms at once (use with ``--threads 1`` on the
2-core CPU: each pair then shares the same conditions).

Answers the target regenerated for the longer EAGLE-3 run are reused when OUT/../smollm2_eagle3 holds them (the
settings file must match, which prepare checks); otherwise the first prepare regenerates them (about an hour).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RECIPE = "recipes/smollm2_distill.yaml"
EAGLE3_RECIPE = "recipes/smollm2_eagle3.yaml"
EAGLE3_KEPT = ["draft.init_from_target=[lm_head,layer,fc]", "draft.noise=0.1", "draft.ttt_steps=3"]
ON_POLICY = ["draft.on_policy=0.5", "draft.on_policy_max_new_tokens=64"]
# name -> (recipe, overrides); "before" is the cut student as cut, saved without training
ARMS: dict[str, tuple[str, list[str]]] = {
    "before": (RECIPE, []),
    "sft": (RECIPE, ["draft.divergence=sft"]),
    "fkl": (RECIPE, ["draft.divergence=fkl"]),
    "rkl": (RECIPE, ["draft.divergence=rkl"]),
    "jsd": (RECIPE, ["draft.divergence=jsd"]),
    "tvd": (RECIPE, ["draft.divergence=tvd"]),
    "fkl_onpolicy": (RECIPE, ["draft.divergence=fkl", *ON_POLICY]),
    "rkl_onpolicy": (RECIPE, ["draft.divergence=rkl", *ON_POLICY]),
    "jsd_onpolicy": (RECIPE, ["draft.divergence=jsd", *ON_POLICY]),
    "tvd_onpolicy": (RECIPE, ["draft.divergence=tvd", *ON_POLICY]),
    "fkl_3layers": (RECIPE, ["draft.divergence=fkl", "draft.cut=every:10"]),
    "fkl_10layers": (RECIPE, ["draft.divergence=fkl", "draft.cut=every:3"]),
    "eagle3": (EAGLE3_RECIPE, EAGLE3_KEPT),
}
MAIN = "fkl"  # the eval's method side, the one HF assisted generation is run with


def run(command: list[str], env: dict) -> None:
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def save_untrained(recipe: str, overrides: list[str], folder: Path) -> None:
    """The cut student exactly as cut from the target, saved as a checkpoint the evaluator loads."""
    from drafttrain.config import load_recipe
    from drafttrain.drafts import build_drafter
    from drafttrain.runfolder import RunFolder
    from drafttrain.targets import load_target

    config = load_recipe(recipe, overrides)
    target = load_target(config.target.model, dtype=config.target.dtype, device=config.target.device)
    drafter = build_drafter(config.draft, target, RunFolder.of(folder))  # the run's draft vocabulary, as train
    drafter.save_pretrained(draft_path(folder), step=0)


def draft_path(folder: Path) -> Path:
    """What the evaluator loads for an arm: the untrained student's folder, else the run (its best checkpoint)."""
    return folder / "untrained" if folder.name == "before" else folder


def last_train_metrics(folder: Path) -> dict:
    """The last logged training values (β = 1 - TVD is "acceptance"), and the steps from the final checkpoint."""
    merged = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if not any(k.startswith("eval/") for k in record):
            merged.update(record)
    latest = (folder / "checkpoints" / "latest").read_text().strip()
    merged["step"] = json.loads((folder / "checkpoints" / latest / "trainer_state.json").read_text())["step"]
    return merged


def held_out_measures(recipe: str, overrides: list[str], folder: Path) -> dict:
    """β = 1 - TVD and top-1 agreement of the arm's draft on the run's held-out rows (what checkpoint evaluation
    logs as val_beta and val_acc_0)."""
    from drafttrain.config import load_recipe
    from drafttrain.drafts import load_drafter
    from drafttrain.evaluation.checkpoint_eval import held_out
    from drafttrain.runfolder import RunFolder, open_dataset
    from drafttrain.targets import load_target

    config = load_recipe(recipe, overrides)
    target = load_target(config.target.model, dtype=config.target.dtype, device=config.target.device)
    drafter = load_drafter(draft_path(folder), target).eval()
    accuracies, measures = held_out(drafter, target, open_dataset(RunFolder.of(folder).validation_split))
    return {"held_out_beta": measures.get("beta"), "held_out_top1": accuracies[0] if accuracies else None}


def arm_overrides(args, name: str, folder: Path) -> tuple[str, list[str]]:
    recipe, overrides = ARMS[name]
    students = args.set_students if recipe == RECIPE else []
    return recipe, [f"output_dir={folder}", f"training.time_budget_minutes={args.minutes}", "training.epochs=50",
                    "training.save_every=100000", "training.keep_last=1", "training.log_every=5",
                    "eval.every_checkpoint=false", "wandb.mode=disabled", *args.set, *students, *overrides]


def prepare_arm(args, env: dict, out: Path, name: str) -> list[str] | None:
    """Prepare the arm's folder (answers from the answer store or an earlier run); its training command, or None
    for the untrained arm, saved as cut."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    answers = out.parent / "smollm2_eagle3"
    for answer_file in ("regenerated.jsonl", "regenerated.dropped.jsonl", "regenerated.settings.json"):
        if (answers / answer_file).is_file() and not (folder / answer_file).exists():
            shutil.copy(answers / answer_file, folder / answer_file)
    recipe, common = arm_overrides(args, name, folder)
    run(["drafttrain", "prepare", recipe, *common, "--no-progress"], env)
    if name == "before":
        save_untrained(recipe, common, folder)
        return None
    return ["drafttrain", "train", recipe, *common]


def record_arm(args, out: Path, name: str, results: dict) -> None:
    folder = out / name
    recipe, common = arm_overrides(args, name, folder)
    logged = {} if name == "before" else last_train_metrics(folder)
    results.setdefault("trained", {})[name] = {
        "overrides": ARMS[name][1], "steps": logged.get("step"), "tokens_per_s": logged.get("tokens_per_s"),
        "acceptance": logged.get("acceptance"), "on_policy_s": logged.get("on_policy_s"),
        **held_out_measures(recipe, common, folder)}
    (out / "bench.json").write_text(json.dumps(results, indent=1))


def train_arms(args, env: dict, out: Path, results: dict) -> None:
    todo = [name for name in args.arms if name not in results.get("trained", {})]
    width = 2 if args.side_by_side else 1
    while todo:
        group, todo = todo[:width], todo[width:]
        commands = {name: prepare_arm(args, env, out, name) for name in group}  # all prepared before any trains
        jobs = {}
        for name, command in commands.items():
            if command is not None:
                print("$", " ".join(command), flush=True)
                jobs[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env,
                                              stderr=(out / name / "train.stderr").open("w"))
        for name, job in jobs.items():
            if job.wait() != 0:
                raise SystemExit(f"training {name} failed:\n{(out / name / 'train.stderr').read_text()[-3000:]}")
        for name in group:
            record_arm(args, out, name, results)


def evaluate_arms(args, env: dict, out: Path, results: dict) -> None:
    """One eval run per (depth, temperature): "auto" lets every arm choose its own depth (plain decoding when
    drafting would cost more than it saves); a fixed depth measures every arm's acceptance at the same shape."""
    for depth in args.depths:
        for temperature in args.temperatures:
            evaluate_once(args, env, out, results, depth, temperature)


def evaluate_once(args, env: dict, out: Path, results: dict, depth: str, temperature: float) -> None:
    key = f"T={temperature:g} depth={depth}"
    if key not in results.get("eval", {}):
        eval_dir = out / f"eval_depth{depth}_T{temperature:g}"
        if eval_dir.exists():
            shutil.rmtree(eval_dir)
        shape = "@auto" if depth == "auto" else ""
        compare = [item for name in args.arms if name != MAIN
                   for item in ("--compare", f"{draft_path(out / name)}{shape}")]
        run(["drafttrain", "eval", "--target", "smollm2-135m-instruct", "--draft", str(out / MAIN), "--depth", depth,
             "--suite", "mt_bench", "--num-prompts", str(args.num_prompts), "--turns", "1", "--max-new-tokens",
             str(args.max_new_tokens), "--temperature", str(temperature), "--threads", str(args.eval_threads),
             "--hf-reference", *compare, "--out", str(eval_dir), "--no-progress"],
            {**env, "OMP_NUM_THREADS": str(args.eval_threads), "MKL_NUM_THREADS": str(args.eval_threads)})
        report = json.loads((eval_dir / "report.json").read_text())
        sides = {MAIN: {"tau": report["overall"]["tau"], "speedup": report["overall"]["speedup"],
                        "depth": report["config"]["depth"], "step_ms": report["overall"].get("step_ms")}}
        for described in report["config"]["compare"]:
            line = report["comparisons"][described["label"]]
            name = Path(described["label"].split("@")[0]).name
            sides["before" if name == "untrained" else name] = {
                "tau": line.get("tau"), "speedup": line.get("speed_vs_baseline"), "depth": described.get("depth")}
        results.setdefault("eval", {})[key] = {"sides": sides, "references": report["references"]}
        (out / "bench.json").write_text(json.dumps(results, indent=1))


def _f(value, digits=2, suffix="") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def print_tables(results: dict, minutes: float) -> None:
    temperatures = list(results.get("eval", {}))
    head = " | ".join(f"τ {t} | speedup {t} | depth {t}" for t in temperatures)
    print(f"\n| arm | steps in {minutes:g} min | β (train) | β (held out) | top-1 (held out) | {head} |")
    print("|---|---|---|---|---|" + "---|" * (3 * len(temperatures)))
    for name, trained in results.get("trained", {}).items():
        cells = []
        for t in temperatures:
            side = results["eval"][t]["sides"].get(name, {})
            cells += [_f(side.get("tau")), _f(side.get("speedup"), suffix="×"), str(side.get("depth", "—"))]
        print(f"| {name} | {trained['steps'] or 0} | {_f(trained['acceptance'], 3)} | "
              f"{_f(trained.get('held_out_beta'), 3)} | {_f(trained.get('held_out_top1'), 3)} | {' | '.join(cells)} |")
    for t in temperatures:
        print(f"\nreferences {t}: {json.dumps(results['eval'][t]['references'])}")
        print(f"method ({MAIN}) step split {t}: {results['eval'][t]['sides'][MAIN].get('step_ms')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every stage (1: steady on a shared CPU)")
    parser.add_argument("--eval-threads", type=int, default=2, help="torch threads for the evaluation runs")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--depths", nargs="+", default=["auto", "2"], help="auto, or fixed chain depths")
    parser.add_argument("--out", default="runs/bench_distill")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides for every arm")
    parser.add_argument("--set-students", nargs="*", default=[], help="recipe overrides for the draft-model arms")
    parser.add_argument("--side-by-side", action="store_true", help="train two arms at once")
    args = parser.parse_args()
    if MAIN not in args.arms:
        parser.error(f"--arms must include {MAIN!r}: the eval's method side and HF assisted generation's pair")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "bench.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    train_arms(args, env, out, results)
    evaluate_arms(args, env, out, results)
    print_tables(results, args.minutes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
