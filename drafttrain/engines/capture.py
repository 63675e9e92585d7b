"""The target's hidden states computed by a serving engine (vLLM's ``extract_hidden_states``), row by row.

A capture server is the target served by vLLM with a dummy draft that keeps the chosen layers' states
(``eagle_aux_hidden_state_layer_ids``: id 0 the embeddings, k the output of decoder layer k, i.e. the input of layer
k, and ``num_hidden_layers`` the final state *before* the final norm) and drafttrain's connector
(connectors/drafttrain_hidden_states.py) writing them, one safetensors file per request: ``hidden_states
[T, ids, H]`` and ``token_ids [T]``. A request is a row's token ids with ``max_tokens=1``; prefix caching and chunked
prefill are off, since both would leave some positions' states uncomputed.

:class:`CaptureClient` keeps at most ``max_in_flight`` rows at the servers at once (round robin over them) and says
when each row's file is whole. A row the engine refuses, a server that stops answering and a file that never comes
are errors naming the row and the cause.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from drafttrain import DrafttrainError
from drafttrain.engines.server import ENGINES, Server, check_exists, port_in_use

CONNECTOR_DIR = Path(__file__).resolve().parent / "connectors"
CONNECTOR_MODULE = "drafttrain_hidden_states"
CONNECTOR_CLASS = "DrafttrainHiddenStatesConnector"
FILE_POLL_S = 0.01


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How one capture server spreads the target: vLLM's own flags (a server per node, or several per node)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: bool = False

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    def args(self) -> list[str]:
        args = ["--tensor-parallel-size", str(self.tensor), "--pipeline-parallel-size", str(self.pipeline),
                "--data-parallel-size", str(self.data)]
        return args + (["--enable-expert-parallel"] if self.expert else [])


def capture_args(layer_ids: list[int], folder: str | Path) -> list[str]:
    """A vLLM server's flags that make it a capture server for ``layer_ids`` writing under ``folder`` (the files'
    paths are the requests' own, which must lie on a filesystem both the server and its readers see)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(folder), "allow_custom_save_path": True}}
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]


def capture_env() -> dict[str, str]:
    """The capture server's environment beside the caller's: where its Python finds drafttrain's connector."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(CONNECTOR_DIR) + (os.pathsep + path if path else "")}


class CaptureClient:
    """Rows sent to capture servers, at most ``max_in_flight`` at once; ``submit`` returns a future of the row's
    file, resolved once the file is whole."""

    def __init__(self, urls: list[str], model: str, max_in_flight: int = 48, file_timeout_s: float = 600.0,
                 request_timeout_s: float = 3600.0):
        if not urls:
            raise DrafttrainError("no capture server to send rows to")
        self.urls, self.model = [u.rstrip("/") for u in urls], model
        self.file_timeout_s, self.request_timeout_s = file_timeout_s, request_timeout_s
        self._next_url = itertools.cycle(self.urls)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight,
                                                           thread_name_prefix="drafttrain-capture")

    def submit(self, row: int, ids: list[int], path: Path) -> concurrent.futures.Future:
        with self._lock:
            url = next(self._next_url)
        return self._pool.submit(self._capture, url, row, ids, Path(path))

    def _capture(self, url: str, row: int, ids: list[int], path: Path) -> Path:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"hidden_states_path": str(path)}}
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as err:
            raise DrafttrainError(f"the capture server {url} refused row {row} ({len(ids)} tokens): "
                                  f"{_engine_message(err)}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise DrafttrainError(f"the capture server {url} did not answer for row {row}: {reason}") from None
        return self._wait_for(path, row, url)

    def _wait_for(self, path: Path, row: int, url: str) -> Path:
        """The connector writes after the answer (on its writer threads) under a temporary name, then renames."""
        deadline = time.monotonic() + self.file_timeout_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise DrafttrainError(f"the capture server {url} answered row {row} but wrote no {path} in "
                                      f"{self.file_timeout_s:.0f} s: is that folder on a filesystem both the server "
                                      "and this process see?")
            time.sleep(FILE_POLL_S)
        return path

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _engine_message(err: urllib.error.HTTPError) -> str:
    """The engine's own words for a refused request (its JSON error's message), else the HTTP status."""
    try:
        payload = json.loads(err.read().decode(errors="replace"))
        message = payload.get("error", {}).get("message") if isinstance(payload.get("error"), dict) \
            else payload.get("message") or payload.get("detail")
    except (ValueError, AttributeError, OSError):
        message = None
    return f"HTTP {err.code}: {str(message or err.reason).strip()[:400]}"


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The model name a running server serves (its /v1/models), for requests to name."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as err:
        raise DrafttrainError(f"the capture server {url} does not answer as an OpenAI-compatible server "
                              f"({getattr(err, 'reason', err)}): start it with `drafttrain capture-server RECIPE`"
                              ) from None


@contextlib.contextmanager
def capture_servers(python: str, model_dir: str, layer_ids: list[int], folder: Path, *, servers: int,
                    parallelism: Parallelism, dtype: str, port: int, max_model_len: int, memory_fraction: float,
                    log_dir: Path, startup_timeout_s: float, extra_args: list[str] = ()):
    """Start ``servers`` capture servers of ``model_dir`` from ``python`` (ports ``port``, ``port + 1``, ...), wait
    until each answers, yield their URLs, and stop them all on the way out (errors and Ctrl-C included)."""
    engine = ENGINES["vllm"]
    check_exists(engine, python)
    args = [*capture_args(layer_ids, folder), *parallelism.args(), "--dtype", dtype,
            "--max-model-len", str(max_model_len), *extra_args]
    started = [Server(engine, python, model_dir, None, port + i, log_dir / f"capture-server{i}.log", memory_fraction,
                      extra_args=args, env=capture_env(), label=f"capture server {i}") for i in range(servers)]
    with contextlib.ExitStack() as stack:
        for server in started:
            if port_in_use(server.port):
                raise DrafttrainError(f"port {server.port} is taken: set capture.port to a free one")
            stack.enter_context(server)
        for server in started:
            try:
                server.wait_ready(startup_timeout_s)
            except DrafttrainError as err:
                raise DrafttrainError(f"{err}{_capture_advice(str(err))}") from None
        yield [server.base_url for server in started]


# what vLLM says when a model cannot be captured, and what to do instead
_CANNOT_CAPTURE = {
    "does not support EAGLE3 interface": "vLLM's class for this model cannot return hidden states (no EAGLE-3 "
                                         "interface), so it cannot capture them",
    "MLA verifiers are unsupported": "vLLM keeps an MLA target's cache with the captured states, so it cannot "
                                     "capture them",
}


def _capture_advice(log: str) -> str:
    reason = next((why for sign, why in _CANNOT_CAPTURE.items() if sign in log), None)
    return "" if reason is None else f"\n{reason}: compute them with capture.engine: hf"
