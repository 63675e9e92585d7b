"""Runs inside vLLM's own venv (never imports drafttrain): serves a draft export with vLLM's offline API on the
given prompt token ids, greedy, and writes what vLLM measured: its spec-decode counters and the generated ids.

    python vllm_worker.py JOB.json OUT.json

JOB: {"target": dir, "draft": dir, "speculative_config": {"method": "eagle3"|"eagle"|"medusa"|"draft_model"|"dflash",
      and e.g. "parallel_drafting": true}, "num_speculative_tokens": k,
      "prompts": [[ids]], "max_tokens": n, "stop_token_ids": [ids], "dtype": "float32"}
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def counters(llm) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            out[name] = [int(v) for v in metric.values]
    return out


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"), max_model_len=2048,
              seed=0, disable_log_stats=False, enforce_eager=True, gpu_memory_utilization=job.get("memory_fraction", 0.3),
              speculative_config={**job["speculative_config"], "model": job["draft"],
                                  "num_speculative_tokens": job["num_speculative_tokens"]})
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], stop_token_ids=job["stop_token_ids"])
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    result = {"counters": counters(llm), "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "seconds": seconds, "vllm_version": __import__("vllm").__version__}
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
