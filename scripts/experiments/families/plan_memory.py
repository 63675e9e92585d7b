"""`drafttrain plan --stage prepare` against the measured peak memory of `drafttrain prepare`, one target per cache
kind: the stage where a target's cache is held (the hf backend regenerates the answers with `generate`).

Targets: the two real built-in ones (SmolLM2-135M: full attention; Gemma 3 270M: sliding windows and full
attention) and published configs of tests/published_configs at their tiny widths, with 32 layers (or as many as
published) so that their cache weighs beside the forward's working set: DeepSeek-V3 (MLA), Llama 4 Scout (chunked
attention), gpt-oss (sliding windows, experts), Qwen3-Next (gated delta-net recurrent layers), LFM2 (short
convolutions), Falcon-H1 (Mamba-2 beside attention in every layer).

Each target answers ``--rows`` prompts cut from eval/long_context.jsonl to ``--prompt-tokens`` tokens each (its own
tokenizer), in one batch, ``--new-tokens`` each, so the plan's widest regeneration batch is the batch that runs
(``data.max_length`` is the longest prompt and its answer; the plan's row is that and one more answer, so it counts
``--new-tokens`` positions a row more than run). Peak = the prepare process's maximum resident set size (the
kernel's count, read by its parent); plan = `drafttrain plan --stage prepare --json` for the same recipe.

    python scripts/experiments/families/plan_memory.py OUT [--targets smollm2 gemma3 deepseek_v3 ...]

Results: OUT/plan_memory.json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from families import published_config, published_text, random_model  # noqa: E402

from drafttrain.data.chat import prompt_ids  # noqa: E402
from drafttrain.targets.loading import load_tokenizer  # noqa: E402

MIB = 2**20
REAL = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}  # name -> built-in target
TINY = {"deepseek_v3": "deepseek_v3", "llama4": "llama4_scout_17b_16e_instruct", "gpt_oss": "gpt_oss_20b",
        "qwen3_next": "qwen3_next_80b_a3b_thinking", "lfm2": "lfm2_1_2b", "falcon_h1": "falcon_h1_0_5b_instruct"}
LAYERS = 32
CACHE_KINDS = {"smollm2": "full", "gemma3": "sliding + full", "deepseek_v3": "MLA, experts", "llama4": "chunked + full, experts",
               "gpt_oss": "sliding + full, experts, eager attention", "qwen3_next": "recurrent + full, experts",
               "lfm2": "convolution + full", "falcon_h1": "Mamba-2 + attention"}
# fewer rows where a row's forward is large: gpt-oss attends eagerly (its sinks: each row's scores, [heads, L, L]
# three times over, 0.3 GB at 1.5k tokens); Falcon-H1's Mamba-2 reference scan holds about 0.2 GB a row (64 rows:
# 17 GiB planned, and the process was killed on this 24 GiB machine)
ROWS = {"gpt_oss": 8, "falcon_h1": 16}
# what the prepare process's peak is read by: its parent's count of its largest child (the kernel's ru_maxrss, KiB)
MEASURE = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
           "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")


def tiny_target(name: str, out: Path) -> str:
    """The published config at its tiny widths and up to 32 layers, saved with SmolLM2's tokenizer."""
    folder = out / f"{name}-target"
    if not (folder / "config.json").is_file():
        published = published_text(TINY[name])
        layers = min(LAYERS, published.get("num_hidden_layers") or published.get("num_layers") or LAYERS)
        random_model(published_config(TINY[name], layers), seed=0).save_pretrained(folder)
        load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return str(folder)


def prompts_file(model: str, rows: int, tokens: int, out: Path) -> tuple[Path, int]:
    """``rows`` one-turn conversations, each a long-context document cut to ``tokens`` tokens of the target's
    tokenizer; returns the file and the longest prompt's token count (its chat template included)."""
    tokenizer = load_tokenizer(model)
    documents = [json.loads(line)["turns"][0] for line in (REPO / "eval" / "long_context.jsonl").open()]
    conversations, longest = [], 0
    for row in range(rows):
        ids = tokenizer(documents[row % len(documents)], add_special_tokens=False)["input_ids"]
        # each row starts elsewhere in its document: the rows differ, their lengths do not
        start = (row // len(documents)) * 97 % max(1, len(ids) - tokens)
        text = tokenizer.decode(ids[start:start + tokens])
        messages = [{"role": "user", "content": text}]
        longest = max(longest, len(prompt_ids(tokenizer, messages)))
        conversations.append({"id": f"long-{row}", "messages": messages})
    path = out / f"prompts-{Path(model).name}.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path, longest


def recipe_for(model: str, data: Path, rows: int, longest: int, new_tokens: int, out: Path) -> Path:
    recipe = {
        "output_dir": str(out / "run"), "seed": 0,
        "target": {"model": model, "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(data)}], "num_samples": rows, "validation_fraction": 0.0,
                 "max_length": longest + new_tokens},  # the prompt and its answer: a row training keeps
        "regenerate": {"enabled": True, "temperature": 0.0, "max_new_tokens": new_tokens, "batch_size": rows,
                       "reuse_answers": False},
        "draft_vocab": {"enabled": False},
        "training": {"hidden_states": "online"},
        "wandb": {"mode": "disabled"},
    }
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def measure(name: str, model: str, args: argparse.Namespace, out: Path) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    rows, tokens = (args.real_rows, args.real_prompt_tokens) if name in REAL else \
        (ROWS.get(name, args.rows), args.prompt_tokens)
    data, longest = prompts_file(model, rows, tokens, folder)
    recipe = recipe_for(model, data, rows, longest, args.new_tokens, folder)
    shutil.rmtree(folder / "run", ignore_errors=True)  # a prepared run would be resumed, not run
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": str(args.threads)}
    planned = json.loads(subprocess.run([sys.executable, "-m", "drafttrain", "plan", str(recipe), "--stage", "prepare",
                                         "--json"], capture_output=True, text=True, env=env, check=True).stdout)
    done = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "drafttrain", "prepare", str(recipe),
                           "--no-progress"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name}: prepare failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    peak = int(done.stdout.rsplit("PEAK_KIB", 1)[1].split()[0]) * 1024
    parts = {k: v / MIB for k, v in planned["memory"].items()}
    return {"target": model, "rows": rows, "prompt_tokens": longest, "new_tokens": args.new_tokens,
            "peak_mib": peak / MIB, "plan_mib": planned["total"] / MIB, "plan_parts_mib": parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--targets", nargs="+", default=[*REAL, *TINY])
    parser.add_argument("--rows", type=int, default=64, help="rows of a tiny target's batch")
    parser.add_argument("--prompt-tokens", type=int, default=1536, help="a tiny target's prompt (window: 2048)")
    parser.add_argument("--real-rows", type=int, default=16)
    parser.add_argument("--real-prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "plan_memory.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for name in args.targets:
        model = REAL.get(name) or tiny_target(name, out)
        results[name] = measure(name, model, args, out)
        results_path.write_text(json.dumps(results, indent=1))
        r = results[name]
        print(f"{name}: peak {r['peak_mib']:.0f} MiB, plan {r['plan_mib']:.0f} MiB", flush=True)
    print("\n| target | cache kinds | rows x prompt | peak (measured) | plan | plan / peak | of which the cache |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        cache = next((v for k, v in r["plan_parts_mib"].items() if k.startswith("KV cache")), 0.0)
        print(f"| {name} | {CACHE_KINDS[name]} | {r['rows']} x {r['prompt_tokens']} | {r['peak_mib']:.0f} MiB | {r['plan_mib']:.0f} MiB "
              f"| {r['plan_mib'] / r['peak_mib']:.2f} | {cache:.0f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
