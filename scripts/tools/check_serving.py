"""Proof in a real client: serve a draft's export in vLLM (CPU) and compare vLLM's own spec-decode counters with
drafttrain's evaluator on the same prompts (greedy, same depth, same stop tokens, same token budget).

    python scripts/tools/check_serving.py RUN_OR_CHECKPOINT [--formats vllm speculators] [--num-prompts 8]
        [--max-new-tokens 64] [--depth 3] [--vllm-python .venvs/vllm/bin/python] [--out DIR] [--trace]
        [--attention-backend CPU_MLA]
    python scripts/tools/check_serving.py MODEL_FOLDER --target NAME [...]   # another trainer's draft model

A plain HF model folder (no drafttrain checkpoint: TRL's student in scripts/experiments/parity/distill.sh) is served as it is
by both: vLLM's draft-model method and drafttrain's draft-model proposer, each over the whole vocabulary.

For each format it exports the draft (drafttrain export), runs scripts/tools/serving/vllm_worker.py in vLLM's own venv
(vLLM is never a drafttrain dependency) and prints, per draft position, the fraction of drafts whose token at that
position was accepted, as vLLM counted it (``vllm:spec_decode_num_accepted_tokens_per_pos / num_drafts``) and as
drafttrain's evaluator measured it (cumulative acceptance), plus τ from each and how many of vLLM's outputs equal
the target's own greedy output. The result is written to OUT/serving_check.json.

``--trace`` has vLLM record every cycle's draft (scripts/tools/serving/vllm_worker.py runs the prompts one at a time in
one process); scripts/tools/serving/replay_block_drafts.py OUT then replays a block draft's cycles in our drafter to show
where and by how much the two disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain import DrafttrainError
from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.decoding import plain_decode
from drafttrain.decoding.proposers import model_folder_proposer
from drafttrain.drafts import load_drafter
from drafttrain.drafts.base import read_draft_config
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.registry import KINDS
from drafttrain.engines.server import ENGINES, check_exists
from drafttrain.evaluation.evaluate import evaluate
from drafttrain.evaluation.suites import load_suite
from drafttrain.export import export_draft
from drafttrain.runfolder import drafttrain_checkpoint, find_draft
from drafttrain.targets import Target, load_target
from drafttrain.targets.loading import resolve_model_dir

WORKER = Path(__file__).with_name("serving") / "vllm_worker.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft", help="a drafttrain run or checkpoint, or a plain HF model folder (with --target)")
    parser.add_argument("--target", help="the target a plain model folder drafts for (a drafttrain draft names its own)")
    parser.add_argument("--formats", nargs="+", default=None, help="default: every format of the kind vLLM reads")
    parser.add_argument("--suite", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--vllm-python", default=".venvs/vllm/bin/python")
    parser.add_argument("--out", default="runs/serving_check")
    parser.add_argument("--trace", action="store_true", help="record vLLM's draft of every cycle")
    parser.add_argument("--attention-backend", default=None,
                        help="vLLM's attention backend for the target and the draft, e.g. CPU_MLA for an MLA target on "
                             "a CPU with AMX tiles (vLLM's AMX backend takes bfloat16 weights alone)")
    args = parser.parse_args()

    check_exists(ENGINES["vllm"], args.vllm_python)  # before minutes of our own decoding, not after them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    side = _checkpoint_side(args, out) if drafttrain_checkpoint(args.draft) else _model_folder_side(args)
    target = side.target
    questions = load_suite(args.suite).select(args.num_prompts, turns=1).questions
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    stops = sorted(stop_token_ids(target.tokenizer, target.model.generation_config))

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    ours = evaluate(target, side.method, questions, depth=side.depth, temperature=0.0,
                    max_new_tokens=args.max_new_tokens, proposer_kwargs=side.proposer_kwargs, baseline=False,
                    warmup=False, progress=False)
    greedy = [plain_decode(target, torch.tensor([ids]), args.max_new_tokens, stop_token_ids=set(stops)).tokens
              for ids in prompts]
    results = {"draft": side.name, "kind": side.kind, "depth": side.depth, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "drafttrain": _ours(ours), "vllm": {}}
    for fmt, (export, speculative_config) in side.exports.items():
        job = {"target": resolve_model_dir(side.target_name), "draft": str(export.resolve()),
               "speculative_config": speculative_config, "num_speculative_tokens": side.depth,
               "prompts": prompts,
               "max_tokens": args.max_new_tokens, "stop_token_ids": stops, "dtype": "float32",
               "trace_drafts": args.trace, "attention_backend": args.attention_backend}
        (out / f"job-{fmt}.json").write_text(json.dumps(job))
        started = time.perf_counter()
        done = subprocess.run([args.vllm_python, str(WORKER), str(out / f"job-{fmt}.json"), str(out / f"vllm-{fmt}.json")],
                              capture_output=True, text=True)
        if done.returncode != 0:
            results["vllm"][fmt] = {"error": done.stderr[-3000:]}
            print(f"{fmt}: vLLM failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        measured = json.loads((out / f"vllm-{fmt}.json").read_text())
        results["vllm"][fmt] = _theirs(measured, greedy, time.perf_counter() - started)
    (out / "serving_check.json").write_text(json.dumps(results, indent=1))
    _print(results)
    return 0 if all("error" not in v for v in results["vllm"].values()) else 1


@dataclasses.dataclass
class Side:
    """What is checked: the draft as our evaluator runs it (a Drafter, or a proposer's name and its arguments) and
    the folders vLLM serves, each with its --speculative-config."""
    name: str
    kind: str
    target: Target
    target_name: str
    method: Any
    proposer_kwargs: dict[str, Any]
    depth: int
    exports: dict[str, tuple[Path, dict[str, Any]]]


def _checkpoint_side(args: argparse.Namespace, out: Path) -> Side:
    """A drafttrain checkpoint: exported here in each format vLLM reads."""
    checkpoint = find_draft(args.draft)
    target_name = read_draft_config(checkpoint)["drafttrain"]["target"]["name"]
    target = load_target(target_name)
    drafter = load_drafter(checkpoint, target).eval()
    codecs = codecs_of(type(drafter))
    formats = args.formats or [f for f in drafter.export_formats() if "vllm" in codecs[f].engines]
    exports = {fmt: (export_draft(checkpoint, fmt, out / f"export-{fmt}", target, overwrite=True,
                                  verifier=str(target.source_dir) if fmt == "speculators" else None),
                     _vllm_config(codecs[fmt].serving(drafter)["vllm"])) for fmt in formats}
    depth = min(args.depth, drafter.max_draft_depth(drafter.config) or args.depth)
    return Side(str(checkpoint), drafter.kind, target, target_name, drafter, {}, depth, exports)


def _model_folder_side(args: argparse.Namespace) -> Side:
    """A plain HF model folder (another trainer's draft model): served as it is, drafting over the whole vocabulary
    on both sides, by the proposer and the vLLM method of the kind that serves model folders."""
    if not args.target:
        raise DrafttrainError(f"{args.draft} is no drafttrain checkpoint: give --target for a plain model folder")
    target = load_target(args.target)
    kind = next(cls for cls in KINDS.values() if cls.proposer == model_folder_proposer())
    folder = Path(args.draft).resolve()
    draft = load_target(str(folder), role="draft model")
    return Side(str(folder), kind.kind, target, args.target, model_folder_proposer(), {"draft": draft}, args.depth,
                {"hf": (folder, {"method": codecs_of(kind)["hf"].engines["vllm"]})})


def _vllm_config(serving) -> dict:
    """What vLLM's speculative config says of the method, from how the format's codec says vLLM serves it."""
    return {"method": serving.method, **serving.options}


def _ours(report) -> dict:
    o = report.overall
    return {"tau": o["tau"], "steps": o["steps"], "accepted_tokens": o["accepted_tokens"],
            "per_position": o["acceptance_per_position"]["cumulative"]}


def _theirs(measured: dict, greedy: list[list[int]], seconds: float) -> dict:
    c = measured["counters"]
    drafts = c["num_drafts"]
    same = sum(list(a) == list(b) for a, b in zip(measured["tokens"], greedy))
    return {"tau": 1 + c["num_accepted_tokens"] / drafts if drafts else None, "steps": drafts,
            "accepted_tokens": c["num_accepted_tokens"],
            "per_position": [n / drafts if drafts else None for n in c["num_accepted_tokens_per_pos"]],
            "outputs_equal_target_greedy": f"{same}/{len(greedy)}", "vllm_version": measured["vllm_version"],
            "wall_s": round(seconds, 1)}


def _print(results: dict) -> None:
    ours = results["drafttrain"]
    print(f"{results['kind']} draft, depth {results['depth']}, {results['prompts']} prompts, greedy")
    print(f"{'':>22} {'τ':>6} {'steps':>6}  acceptance by position")
    rows = [("drafttrain evaluator", ours)] + [(f"vLLM ({fmt})", v) for fmt, v in results["vllm"].items()
                                               if "error" not in v]
    for name, r in rows:
        positions = " ".join(f"{p:.3f}" if p is not None else "  —  " for p in r["per_position"])
        extra = f"  outputs = target greedy: {r['outputs_equal_target_greedy']}" if "outputs_equal_target_greedy" in r else ""
        print(f"{name:>22} {r['tau']:>6.3f} {r['steps']:>6}  {positions}{extra}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DrafttrainError as err:
        sys.exit(f"check_serving: {err}")
