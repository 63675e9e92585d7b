"""The ``capture`` section: what computes the target's hidden states for training. ``hf`` is the target's own
forward in drafttrain's processes; ``vllm`` is the target served by vLLM (its ``extract_hidden_states`` method) with
the parallelism it serves with, writing each row's states to a file drafttrain reads: into the offline cache
(``training.hidden_states: offline``, written by ``prepare``) or streamed to training as it runs
(``training.hidden_states: stream``), so the trainers never hold the target's layers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from drafttrain.config.base import Section


class CaptureConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"  # who runs the target: drafttrain (hf) or a vLLM capture server
    # A Python with vLLM installed (its own venv, never a drafttrain dependency): drafttrain starts ``servers``
    # capture servers on this machine from it and stops them when done
    python: str | None = None
    # Capture servers already running, e.g. on other nodes (`drafttrain capture-server RECIPE` starts one there),
    # each with its own parallelism; used instead of starting any
    urls: list[str] = []
    servers: int = Field(1, gt=0)  # capture servers drafttrain starts here (each with the parallelism below)
    tensor_parallel_size: int = Field(1, gt=0)  # vLLM's --tensor-parallel-size, per server
    pipeline_parallel_size: int = Field(1, gt=0)  # vLLM's --pipeline-parallel-size (its layers in stages on one node)
    data_parallel_size: int = Field(1, gt=0)  # vLLM's --data-parallel-size (replicas inside one server)
    expert_parallel: bool = False  # vLLM's --enable-expert-parallel (MoE targets)
    # the dtype the engine computes in; auto: the recipe's target.dtype
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # on a CPU, the share of RAM its KV cache may take
    # rows at the servers at once (a prepare's requests in flight; vLLM batches their prefills)
    max_in_flight: int = Field(48, gt=0)
    # a stream: rows each training process has requested ahead of its use, in micro-batches (each micro-batch's
    # files are deleted once read); the files on disk are at most window x batch_size rows a process
    window: int = Field(8, gt=0)
    # where the servers write their files and drafttrain reads them: a filesystem both see (servers on other nodes:
    # a shared one); None: ``capture/`` in the run folder
    folder: str | None = None
    port: int = Field(8200, gt=0, lt=65536)  # the first server's port (the next ones count up)
    startup_timeout_s: float = Field(1800.0, gt=0)  # a large target loads for minutes
    server_args: list[str] = []  # passed to every server as they are (--max-num-seqs 64, --enforce-eager, ...)

    @model_validator(mode="after")
    def _servers_given(self) -> "CaptureConfig":
        if self.engine == "vllm" and self.python is None and not self.urls:
            raise ValueError("capture.engine vllm: give capture.python (a Python with vLLM: drafttrain starts the "
                             "servers) or capture.urls (servers already running)")
        if self.engine == "hf" and (self.python is not None or self.urls):
            raise ValueError("capture.python / capture.urls are for capture.engine: vllm")
        return self

    @property
    def parallel_gpus(self) -> int:
        """GPUs one capture server takes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size
