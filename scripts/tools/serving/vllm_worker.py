"""Runs inside vLLM's own venv (never imports drafttrain): serves a draft export with vLLM's offline API on the
given prompt token ids, greedy, and writes what vLLM measured: its spec-decode counters and the generated ids.

    python vllm_worker.py JOB.json OUT.json

JOB: {"target": dir, "draft": dir, "speculative_config": {"method": "eagle3"|"eagle"|"medusa"|"draft_model"|"dflash",
      and e.g. "parallel_drafting": true}, "num_speculative_tokens": k,
      "prompts": [[ids]], "max_tokens": n, "stop_token_ids": [ids], "dtype": "float32",
      "trace_drafts": false, "attention_backend": null (vLLM's choice) or e.g. "CPU_MLA"}

With "trace_drafts", the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the prompts go one at a
time, and OUT also holds, per prompt, every cycle's draft: each drafted slot's token and the draft's five best
tokens with their logits, as vLLM computed them (scripts/tools/check_serving.py --trace asks for it;
scripts/tools/serving/replay_block_drafts.py replays those cycles in drafttrain's drafter to find where the two disagree).
"""

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__" and len(sys.argv) > 1 and json.loads(Path(sys.argv[1]).read_text()).get("trace_drafts"):
    # must be set before vLLM starts an engine: the proposer has to live in this process to be watched
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


def counters(llm) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            out[name] = [int(v) for v in metric.values]
    return out


class DraftTrace:
    """Records what the proposer drafts: one list of slots per propose() call (a cycle), each slot its token and
    the draft's top five (target vocabulary ids, logits), read from the same hidden states vLLM sampled from."""

    def __init__(self):
        self.cycles: list[list[dict]] = []
        propose, greedy = SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer._greedy_sample
        trace = self

        def traced_propose(proposer, *args, **kwargs):
            trace.cycles.append([])
            return propose(proposer, *args, **kwargs)

        def traced_greedy(proposer, hidden_states):
            tokens = greedy(proposer, hidden_states)
            trace.cycles[-1] += trace._slots(proposer, hidden_states, tokens)
            return tokens

        SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer._greedy_sample = traced_propose, traced_greedy

    @staticmethod
    def _slots(proposer, hidden_states, tokens) -> list[dict]:
        logits = proposer.model.compute_logits(hidden_states).float()
        if proposer.use_heterogeneous_vocab:
            logits = proposer.vocab_mapping.constrain_draft_logits(logits)
        top = logits.topk(5, dim=-1)
        ids = top.indices
        if proposer.use_heterogeneous_vocab:
            ids = proposer.vocab_mapping.map_draft_to_target_ids(ids.flatten()).view_as(ids)
        return [{"token": int(t), "top_ids": i.tolist(), "top_logits": v.tolist()}
                for t, i, v in zip(tokens.flatten(), ids, top.values)]

    def take(self) -> list[list[dict]]:
        cycles, self.cycles = self.cycles, []
        return cycles


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    # an attention backend named by the job, for the target and the draft: MLA on a CPU with AMX tiles takes bfloat16
    # weights alone, CPU_MLA float32 too
    backend = {"attention_backend": job["attention_backend"]} if job.get("attention_backend") else {}
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"), max_model_len=2048,
              seed=0, disable_log_stats=False, enforce_eager=True, gpu_memory_utilization=job.get("memory_fraction", 0.3),
              speculative_config={**job["speculative_config"], "model": job["draft"],
                                  "num_speculative_tokens": job["num_speculative_tokens"], **backend}, **backend)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], stop_token_ids=job["stop_token_ids"])
    started = time.perf_counter()
    if job.get("trace_drafts"):
        trace, outputs, cycles = DraftTrace(), [], []
        for ids in job["prompts"]:
            outputs += llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            cycles.append(trace.take())
    else:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    result = {"counters": counters(llm), "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "seconds": seconds, "vllm_version": __import__("vllm").__version__}
    if job.get("trace_drafts"):
        result["draft_cycles"] = cycles
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
