"""vLLM's hidden-state writer for drafttrain's target capture: loaded by the engine itself
(``kv_connector_module_path``), from its own Python, so it imports vLLM and never drafttrain.

vLLM's ``ExampleHiddenStatesConnector`` copies the captured states through pinned memory on a CUDA stream; this
one does that on a GPU and, where the engine runs on a CPU (no pinned memory, no streams), copies them and writes
the file on its writer threads directly. Each file is ``{hidden_states [T, n_ids, H], token_ids [T]}`` at the
path the request named (``kv_transfer_params.hidden_states_path``), written under a temporary name and renamed,
so a reader never sees half a file."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """A copy that finished when it was made (the CPU path): what get_finished polls instead of a CUDA event."""

    @staticmethod
    def query() -> bool:
        return True


def _write(tensors: dict, event, filename: str, lock_fd: int | None) -> None:
    try:
        if hasattr(event, "synchronize"):
            event.synchronize()
        partial = filename + ".partial"
        save_file(tensors, partial)
        os.replace(partial, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


class DrafttrainHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a CPU path, and files that appear whole (written, then renamed)."""

    _write_tensors = staticmethod(_write)

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(_write, tensors, _Done(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
