"""``drafttrain bench DRAFT [DRAFT ...]``: serve the target in a real engine, plainly and with each draft, and sweep
the number of concurrent requests; writes OUT/report.json, report.md and bench.png (and a copy beside each draft's
checkpoint, for its model card).

Exit codes: 0 ok, 2 bad input or an engine that failed (the message names the cause, with the server's log tail),
1 the engine's acceptance at one stream disagrees with drafttrain eval's τ (the report says by how much).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from pydantic import ValidationError

from drafttrain import DrafttrainError
from drafttrain.config import BenchConfig, describe_errors
from drafttrain.serving.bench import NGRAM, BenchInputs, run_bench

_DEFAULTS = BenchConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafts", nargs="+", metavar="DRAFT",
                        help=f"a run, checkpoint or export folder (an export is served as written; a run is exported "
                             f"in the first format the engine reads), or {NGRAM!r} for the engine's own n-gram lookup")
    parser.add_argument("--target", help="the target (default: the one the first draft was trained for)")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default=_DEFAULTS.engine,
                        help="sglang is built from its documented flags and untested here (it needs a GPU)")
    parser.add_argument("--vllm-python", "--engine-python", dest="python",
                        default=os.environ.get("DRAFTTRAIN_VLLM_PYTHON"),
                        help="the Python of an environment with the engine (and pandas, for its load generator) "
                             "installed; default $DRAFTTRAIN_VLLM_PYTHON")
    parser.add_argument("--base-url", help="a draft server already running (one draft, one length); the plain one "
                                           "is --plain-base-url")
    parser.add_argument("--plain-base-url")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--suite", default="mt_bench", help="a built-in suite or a FastChat question file: first "
                                                              "turns")
    prompts.add_argument("--request-log", help="an OpenAI-format request log (chat completions JSONL): its distinct "
                                               "prompts, system prompts and tools kept")
    parser.add_argument("--num-prompts", type=int, default=_DEFAULTS.num_prompts,
                        help="how many distinct prompts (default: all); a level needing more sends them again")
    parser.add_argument("--concurrency", type=int, nargs="+", default=_DEFAULTS.concurrency)
    parser.add_argument("--num-speculative-tokens", "-k", type=int, nargs="+",
                        default=_DEFAULTS.num_speculative_tokens, help="draft lengths: one server per length")
    parser.add_argument("--output-len", type=int, default=_DEFAULTS.output_len, help="new tokens per request, at most")
    parser.add_argument("--temperature", type=float, default=_DEFAULTS.temperature)
    parser.add_argument("--min-requests", type=int, default=_DEFAULTS.min_requests)
    parser.add_argument("--requests-per-stream", type=int, default=_DEFAULTS.requests_per_stream)
    parser.add_argument("--repeats", type=int, default=_DEFAULTS.repeats,
                        help="passes over the levels (the sides' order alternates)")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port, help="the first of the servers' ports")
    parser.add_argument("--dtype", default=_DEFAULTS.dtype,
                        help="the servers' dtype (default %(default)s, as drafttrain's evaluator computes, so the "
                             "one-stream agreement compares like with like; on a GPU serve what you serve, bfloat16, "
                             "and expect a near-tie or two to separate the two τ)")
    parser.add_argument("--memory-fraction", type=float, default=_DEFAULTS.memory_fraction,
                        help="of the machine's (or GPU's) memory, for all servers together")
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        help="an argument for every server, as it is (repeat it: --server-arg=--enforce-eager)")
    parser.add_argument("--agreement-tolerance", type=float, default=_DEFAULTS.agreement_tolerance)
    parser.add_argument("--startup-timeout", type=float, default=_DEFAULTS.startup_timeout_s, help="seconds")
    parser.add_argument("--out", required=True, help="the report's folder")


def settings_of(args: argparse.Namespace) -> BenchConfig:
    values = dict(engine=args.engine, concurrency=args.concurrency, num_speculative_tokens=args.num_speculative_tokens,
                  output_len=args.output_len, temperature=args.temperature, min_requests=args.min_requests,
                  requests_per_stream=args.requests_per_stream, repeats=args.repeats, port=args.port,
                  dtype=args.dtype, memory_fraction=args.memory_fraction, server_args=args.server_args,
                  agreement_tolerance=args.agreement_tolerance, startup_timeout_s=args.startup_timeout,
                  num_prompts=args.num_prompts)
    try:
        return BenchConfig.model_validate(values)
    except ValidationError as err:
        flags = {"startup_timeout_s": "--startup-timeout", "server_args": "--server-arg"}
        raise DrafttrainError(describe_errors(err, lambda loc: flags.get(loc[0], "--" + loc[0].replace("_", "-"))
                                              if loc else "")) from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the servers the same way Ctrl-C does


def run(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    inputs = BenchInputs(args.drafts, args.target, args.python, args.base_url, args.plain_base_url,
                         args.suite, args.request_log)
    signal.signal(signal.SIGTERM, _interrupt)
    report = run_bench(inputs, settings, Path(args.out))
    print(Path(args.out, "report.md").read_text())
    return 1 if report["errors"] else 0
