"""The target's outputs captured by serving engines (engines/capture.py): into the offline cache (``prepare``), or
streamed to training as it runs.

Rows are sent ahead of their use: ``ask`` gives the order, and at most ``window`` rows are requested and not yet
read (a stream's bounded window of files; a capture's requests in flight). ``states``/``outputs`` wait for a row's
file, check that the engine saw the row's tokens, read it and delete it. The engine gives the final state before
the final norm; the target's own norm makes it the state its lm_head reads, and logits come from that through the
head, so a process fed by an engine holds the target's embeddings, norm and head only (targets/partial.py).

What a stream costs training is measured: seconds waited for files, tokens delivered per second by the engines
against tokens consumed per second by training; ``stats`` reports them and ``lagging`` says when training waits.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from drafttrain import DrafttrainError
from drafttrain.engines.capture import CaptureClient
from drafttrain.sources.base import PRENORM, ROW_INDEX, TargetSource, argmax_entry, assemble, states_of_slots
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, logits_from_final, top_k_of
from drafttrain.userfiles import remove

# training waits more than this share of its time for the engines: say so
LAGGING_SHARE = 0.05
MARKER = ".drafttrain-capture"  # a folder of captured rows drafttrain made (what it may delete rows from)


def engine_layer_ids(needs: TargetNeeds, num_layers: int, prenorm: bool = False) -> list[int]:
    """The engine's layer ids for what a cache keeps: the same numbers (id k is the input of decoder layer k; id
    num_layers is the final state, taken before the norm and normed here), the final state always with ``prenorm``."""
    return sorted(set(needs.stored_layers(num_layers)) | ({num_layers} if prenorm else set()))


def _made_here(folder: Path) -> bool:
    return (folder / MARKER).is_file()


class EngineSource(TargetSource):
    """Rows captured by engines through ``client`` into ``folder`` (see the module docstring)."""

    name = "engine"

    def __init__(self, target: Target, needs: TargetNeeds, dataset, client: CaptureClient, folder: Path,
                 window: int, cache_argmax: bool = False, prenorm: bool = False):
        super().__init__(target, needs, prenorm)
        self.dataset, self.client, self.folder, self.window = dataset, client, Path(folder), max(1, window)
        self.layer_ids = engine_layer_ids(needs, target.num_layers, prenorm)
        self.cache_argmax = cache_argmax
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / MARKER).touch()
        self._upcoming: Iterator[int] = iter(())
        self._pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._requested, self._serial = 0, 0
        self._waited_s, self._tokens, self._rows = 0.0, 0, 0
        self._started: float | None = None  # the first ask: what the stream's rates are measured over

    # -- requests ahead of use ---------------------------------------------------------------------------
    def ask(self, rows: Iterable[int]) -> None:
        self._started = self._started or time.monotonic()
        self._upcoming = iter(rows)
        self._fill()

    def _fill(self) -> None:
        while self._requested < self.window:
            row = next(self._upcoming, None)
            if row is None:
                return
            self._submit(int(row))

    def _submit(self, row: int) -> None:
        ids = list(self.dataset[row]["input_ids"])
        path = self.folder / f"{self._serial:09d}-row{row}.safetensors"
        self._serial += 1
        self._pending[row].append((self.client.submit(row, ids, path), ids))
        self._requested += 1

    # -- reading -----------------------------------------------------------------------------------------
    def _take(self, row: int) -> dict[str, torch.Tensor]:
        if not self._pending[row]:  # asked for without being announced: request it now
            self._submit(row)
        future, ids = self._pending[row].popleft()
        waiting = time.monotonic()
        path = future.result()
        self._waited_s += time.monotonic() - waiting
        self._requested -= 1
        states = self._read(path, row, ids)
        self._fill()
        self._rows, self._tokens = self._rows + 1, self._tokens + len(ids)
        return states

    def _read(self, path: Path, row: int, ids: list[int]) -> dict[str, torch.Tensor]:
        try:
            captured = load_file(str(path))
            hidden, tokens = captured["hidden_states"], captured["token_ids"]
        except (SafetensorError, OSError, KeyError) as err:
            raise DrafttrainError(f"the capture engine's file for row {row}, {path}, cannot be read "
                                  f"({str(err).splitlines()[0][:200]})") from None
        finally:
            for done in (path, path.with_name(path.name + ".lock")):
                remove(done, "a captured row, once read", inside=self.folder, made=_made_here)
        if tokens.tolist() != ids:
            raise DrafttrainError(f"the capture engine's file for row {row} holds other tokens than the row "
                                  f"({len(tokens)} tokens, the row has {len(ids)}): is the server serving this "
                                  "recipe's target with prefix caching off?")
        if hidden.shape[1:] != (len(self.layer_ids), self.target.hidden_size):
            raise DrafttrainError(f"the capture engine's file for row {row} holds states of shape "
                                  f"{tuple(hidden.shape)}, this recipe needs {len(self.layer_ids)} layers "
                                  f"{self.layer_ids} of width {self.target.hidden_size}: the server was started for "
                                  "other layers (start it with `drafttrain capture-server` and this recipe)")
        return self._entries(hidden.to(self.target.model.dtype))

    @torch.no_grad()
    def _entries(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        entries = states_of_slots(hidden, self.layer_ids, self.target)  # the engine's final state comes before the norm
        prenorm = entries.pop(PRENORM, None)
        if self.prenorm:
            entries[PRENORM] = prenorm
        last = f"layer{self.target.num_layers}"
        if last in entries:
            if self.cache_argmax:
                entries["argmax"] = argmax_entry(self.target, entries[last])
            if self.needs.logits and self.needs.logits_top_k is not None:
                final = entries[last][None].to(self.target.device)
                kept = top_k_of(logits_from_final(self.target, final)[0], self.needs.logits_top_k,
                                self.needs.logits_temperature)
                entries.update(topk_ids=kept.ids.to(torch.int32).cpu(), topk_log_probs=kept.log_probs.cpu(),
                               topk_rest=kept.rest.cpu())
        return entries

    def states(self, rows: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self._take(int(row)) for row in rows]

    def outputs(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        per_row = self.states(batch[ROW_INDEX].tolist())
        return assemble(per_row, batch["input_ids"].shape[1], self.target, self.needs)

    # -- what the stream costs -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - (self._started or time.monotonic()), 1e-9)
        working = max(elapsed - self._waited_s, 1e-9)
        return {"stream/wait_s": self._waited_s, "stream/wait_share": self._waited_s / elapsed,
                "stream/tokens_per_s_delivered": self._tokens / elapsed,
                "stream/tokens_per_s_consumed": self._tokens / working, "stream/rows": float(self._rows)}

    def lagging(self) -> str | None:
        """A line when training waits for the engines more than LAGGING_SHARE of its time."""
        stats = self.stats()
        if stats["stream/wait_share"] <= LAGGING_SHARE or not self._rows:
            return None
        return (f"training waits {100 * stats['stream/wait_share']:.0f}% of its time for the capture engines: they "
                f"deliver {stats['stream/tokens_per_s_delivered']:.0f} tokens/s, training would consume "
                f"{stats['stream/tokens_per_s_consumed']:.0f}: add capture servers (capture.urls or "
                "capture.servers) or widen capture.window")

    def close(self) -> None:
        self.client.close()
        for deque in self._pending.values():
            for future, _ in deque:
                future.cancel()
