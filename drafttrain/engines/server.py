"""The serving engines drafttrain drives: how each is started, told about a draft (bench, evaluation) or asked for
the target's hidden states (capture), and counted.

An engine is never a drafttrain dependency: it runs from its own Python (``--vllm-python``, ``capture.python``),
started here as an OpenAI-compatible server with its log in a file, or already running (a URL). A server that exits
before it is ready, or while it works, is an error that quotes its log's tail; every server started here is stopped
on the way out, also on Ctrl-C and on errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from drafttrain import DrafttrainError
from drafttrain.engines.metrics import SpecCounters, by_label, counter_samples, total
from drafttrain.userfiles import cause

LOG_TAIL_CHARS = 3000
PR_SET_PDEATHSIG = 1
HEALTH_POLL_S = 2.0
FIRST_ERROR = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")
PLAIN = "plain"  # the label of a server that serves the target alone


@dataclasses.dataclass(frozen=True)
class Serving:
    """How one engine is told to serve a draft written in one format (a format's codec says it): the engine's
    speculative method, what its speculative config needs beside the method, the model and the length, and whether
    the export names its verifier (the engine may then be given the export alone)."""

    method: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    names_verifier: bool = False


@dataclasses.dataclass(frozen=True)
class Speculation:
    """One way to serve the target with a draft: a label for the report, the draft length, and how each engine that
    can serve it is told to (``serving``: {engine name: Serving})."""

    label: str
    length: int
    serving: dict[str, Serving]
    model: str | None = None  # the export folder (None: a draft-free proposer such as n-gram lookup)
    weights_sha256: str | None = None  # the checkpoint's, so the sweep can be put on that checkpoint's card


class Engine:
    name: ClassVar[str]
    server_module: ClassVar[str]
    tested: ClassVar[bool]
    # what its Python must import (the engine, and the load generator's needs); prints the engine's version
    requirement: ClassVar[str]

    def server_args(self, target: str, port: int, spec: Speculation | None, memory_fraction: float) -> list[str]:
        raise NotImplementedError

    steps_counter: ClassVar[str]  # counts verification steps; a server without it does not speculate

    def counters(self, metrics_text: str) -> SpecCounters | None:
        """The speculative counters of a /metrics reading (None: the server speculates not)."""
        samples = counter_samples(metrics_text)
        steps = total(samples, self.steps_counter)
        return None if steps is None else self.read_counters(samples, steps)

    def read_counters(self, samples: dict, steps: float) -> SpecCounters:
        raise NotImplementedError

    def serving_of(self, spec: Speculation) -> Serving:
        if self.name not in spec.serving:
            raise DrafttrainError(f"{self.name} has no speculative method for {spec.label} (engines that serve it: "
                                  f"{', '.join(spec.serving) or 'none'})")
        return spec.serving[self.name]

    def card_command(self, serving: Serving, target: str, depth: int) -> str:
        """How a user serves an export (THIS_REPO) beside ``target`` with this engine: the model card's text."""
        raise NotImplementedError


class VLLM(Engine):
    name, server_module, tested = "vllm", "vllm.entrypoints.openai.api_server", True
    # the load generator's imports (serving.loadgen_driver) as well as the engine's
    requirement = ("import vllm, vllm.benchmarks.serve, vllm.utils.argparse_utils, pandas; "
                   "print(vllm.__version__)")

    def server_args(self, target: str, port, spec, memory_fraction):
        args = ["--model", target, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
                # on a CPU this is the share of RAM its KV cache may take, as on a GPU of the GPU's memory
                "--gpu-memory-utilization", f"{memory_fraction:.3f}"]
        if spec is not None:
            serving = self.serving_of(spec)
            config = {"method": serving.method, **serving.options, "num_speculative_tokens": spec.length}
            if spec.model is not None:
                config["model"] = spec.model
            args += ["--speculative-config", json.dumps(config)]
        return args

    def card_command(self, serving: Serving, target: str, depth: int) -> str:
        if serving.names_verifier:
            return ("A [speculators](https://github.com/vllm-project/speculators) model: vLLM reads the verifier from "
                    "its config.\n\n```bash\nvllm serve THIS_REPO\n```\n\nor with the target named:\n\n```bash\n"
                    f"vllm serve {target} --speculative-config "
                    f"'{json.dumps({'model': 'THIS_REPO', 'num_speculative_tokens': depth})}'\n```")
        config = json.dumps({"method": serving.method, **serving.options, "model": "THIS_REPO",
                             "num_speculative_tokens": depth})
        return f"```bash\nvllm serve {target} --speculative-config '{config}'\n```"

    steps_counter = "vllm:spec_decode_num_drafts_total"

    def read_counters(self, samples, steps):
        per = by_label(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
        return SpecCounters(steps, total(samples, "vllm:generation_tokens_total") or 0.0,
                            total(samples, "vllm:spec_decode_num_accepted_tokens_total"),
                            total(samples, "vllm:spec_decode_num_draft_tokens_total"),
                            tuple(per[k] for k in sorted(per, key=int)))


class SGLang(Engine):
    """Untested here (SGLang needs a GPU): built from its documented server flags and metrics. It counts
    verification calls and output tokens, not accepted tokens per position."""

    name, server_module, tested = "sglang", "sglang.launch_server", False
    requirement = ("import sglang, vllm.benchmarks.serve, vllm.utils.argparse_utils, pandas; "
                   "print(sglang.__version__)")

    def server_args(self, target: str, port, spec, memory_fraction):
        args = ["--model-path", target, "--host", "127.0.0.1", "--port", str(port), "--enable-metrics",
                "--random-seed", "0", "--mem-fraction-static", f"{memory_fraction:.3f}"]
        if spec is not None:
            args += ["--speculative-algorithm", self.serving_of(spec).method, "--speculative-num-steps", str(spec.length),
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(spec.length + 1)]
            if spec.model is not None:
                args += ["--speculative-draft-model-path", spec.model]
        return args

    def card_command(self, serving: Serving, target: str, depth: int) -> str:
        return ("```bash\npython -m sglang.launch_server --model-path " + target + " \\\n"
                f"  --speculative-algorithm {serving.method} --speculative-draft-model-path THIS_REPO"
                f" \\\n  --speculative-num-steps {depth} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
                f"{depth + 1}\n```")

    steps_counter = "sglang:spec_verify_calls_total"

    def read_counters(self, samples, steps):
        return SpecCounters(steps, total(samples, "sglang:generation_tokens_total") or 0.0)


ENGINES: dict[str, Engine] = {e.name: e for e in (VLLM(), SGLang())}


def register_engine(engine: Engine) -> None:
    """Another serving engine: the codecs that serve on it name it in their ``engines``."""
    ENGINES[engine.name] = engine


def unregister_engine(name: str) -> None:
    ENGINES.pop(name, None)


def check_exists(engine: Engine, python: str) -> None:
    if not Path(python).is_file():
        raise DrafttrainError(f"--{engine.name}-python {python} does not exist: give the Python of an environment "
                              f"with {engine.name} installed (it is never a drafttrain dependency)")


def check_python(engine: Engine, python: str) -> str:
    """The engine's version in ``python`` (which exists: ``check_exists``); refused, before anything starts, when
    that Python cannot run the engine's server and the load generator."""
    try:
        done = subprocess.run([python, "-c", engine.requirement], capture_output=True, text=True)
    except OSError as err:  # a file that is no program (Exec format error), or not executable
        raise DrafttrainError(f"--{engine.name}-python {python} cannot be run: {cause(err)}; give the Python "
                              f"(bin/python) of an environment with {engine.name} installed") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DrafttrainError(f"{python} cannot run {engine.name} and its load generator ({engine.requirement}): "
                              f"{last}. Install {engine.name} there, with pandas for `vllm bench serve`")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"


def _stop_with_parent() -> None:
    """In the child, before the engine starts: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path) -> str:
    """The log's last lines, and its first exception line when the tail lost it (a worker's root cause usually
    comes long before the launcher's last words)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = text[-LOG_TAIL_CHARS:]
    errors = (FIRST_ERROR.search(line) for line in text.splitlines() if "WARNING" not in line)
    first = next((found.group(0).strip() for found in errors if found), None)
    if first is not None and first not in tail:
        return f"first error: {first}\n...\n{tail}"
    return tail


def ready(base_url: str) -> bool:
    """Whether the server at ``base_url`` answers its health check."""
    with contextlib.suppress(OSError, urllib.error.URLError):
        return urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5).status == 200
    return False


class Server:
    """One engine server: started (``start``), waited for (``wait_ready``), stopped on exit of its ``with``."""

    def __init__(self, engine: Engine, python: str | None, target: str, spec: Speculation | None, port: int,
                 log: Path, memory_fraction: float, base_url: str | None = None, extra_args: list[str] = (),
                 env: dict[str, str] | None = None, label: str | None = None):
        self.engine, self.python, self.target, self.spec, self.port, self.log = \
            engine, python, target, spec, port, log
        self.extra_args = list(extra_args)
        self.env = env or {}  # what the engine's process needs beside this one's environment
        self._label = label
        self.memory_fraction = memory_fraction
        self.base_url = base_url or f"http://127.0.0.1:{port}"
        self.external = base_url is not None
        self.process: subprocess.Popen | None = None

    @property
    def label(self) -> str:
        if self._label is not None:
            return self._label
        return PLAIN if self.spec is None else f"{self.spec.label} k={self.spec.length}"

    def start(self) -> None:
        if self.external:
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [self.python, "-m", self.engine.server_module,
                   *self.engine.server_args(self.target, self.port, self.spec, self.memory_fraction),
                   *self.extra_args]
        self.log.write_text("$ " + " ".join(command) + "\n")
        with self.log.open("a") as out:
            # its own process group, so stopping it stops the engine's worker processes too; and told to stop when
            # drafttrain dies, even by SIGKILL, which no handler of ours sees
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_stop_with_parent, env={**os.environ, **self.env})

    def ready(self) -> bool:
        return ready(self.base_url)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            self.check_alive("while starting")
            if time.monotonic() > deadline:
                raise DrafttrainError(f"the {self.engine.name} server for {self.label} was not ready after "
                                      f"{timeout_s:.0f} s" + self.log_text())
            time.sleep(HEALTH_POLL_S)

    def check_alive(self, when: str) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise DrafttrainError(f"the {self.engine.name} server for {self.label} exited (code "
                                  f"{self.process.returncode}) {when}" + self.log_text())

    def stop(self) -> None:
        """Stop the server's whole process group: also after its leader crashed, when the engine's workers may
        still hold memory and ports."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group ignored SIGTERM
        self.process.wait()

    def log_text(self) -> str:
        return "" if self.external else f"; the tail of its log ({self.log}):\n{log_tail(self.log)}"

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
