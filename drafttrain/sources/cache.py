"""The offline cache of target outputs: a source (the HF forward, or capture engines) computes them once over the
train split (``drafttrain prepare``), and training reads what the draft kind needs from disk instead of running the
target at every step: the cache is itself a source (:class:`FeatureCache`).

Per row the cache keeps each hidden state the kind needs exactly once (its taps, and the final hidden state when
the kind needs it or the logits), in the target's dtype unless the recipe chooses another
(``training.feature_dtype``). Logits are not stored (V-wide, ~100x larger): they are recomputed from the final
hidden state through the target's own output path (drafttrain.targets.outputs.logits_from_final). The cache also
keeps the target's argmax over the whole vocabulary (4 bytes a token): a draft that trains over a draft vocabulary
needs it (positions whose answer the draft cannot name are left out), and with it training computes the logits of
the draft vocabulary's rows only, not the whole head at every step.

Shards are safetensors written to a temporary name and renamed, each followed by its record (rows, size, sha256);
``drafttrain prepare`` under a launcher gives every process its own shards, and a rerun writes only the shards
that have no record (a process that dies loses only the shard it was writing). ``index.json`` joins the records
with the settings: the target, the layers, the dtype, the target's fingerprint and the fingerprint of the split the
rows come from, so a cache built for other data, another target or other layers is refused instead of silently
feeding the wrong rows.

In speculators' layout (``training.cache_layout: speculators``, drafttrain.sources.speculators) each row's hidden
states are a file of their own, in speculators' form (the final state kept before the norm and normed when read,
as an engine's), beside speculators' prepared dataset; a shard then keeps the rest of its rows (the argmax) and
its record each row's file and sha256. With ``training.cache_from`` those files are a capture speculators made,
each train row given the one holding its token ids.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.progress import progress_bar
from drafttrain.runfolder import damaged, file_sha256, read_json, write_text_atomic
from drafttrain.sources.base import ROW_INDEX, TargetSource, argmax_entry, assemble, cached_names, states_of_slots
from drafttrain.sources.hf import HFForward
from drafttrain.sources.speculators import (
    check_match,
    describe_missing,
    layout_refusal,
    match_rows,
    read_row,
    slot_layers,
    write_prepared_dataset,
    write_row,
)
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, plain_rows
from drafttrain.userfiles import remove

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT_VERSION = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def stored(hidden: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """How one hidden-state tensor (T, H) is kept: in ``dtype``; float8 with a bfloat16 scale per token (absmax, so
    a token with a massive activation does not crush the others' precision): H + 2 bytes per token."""
    if dtype != torch.float8_e4m3fn:
        return {"": hidden.to(dtype).cpu().contiguous()}
    absmax = hidden.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    scale = (absmax * (1.01 / FP8_MAX)).to(torch.bfloat16)  # 1% headroom: the bf16 rounding never overflows fp8
    quantised = (hidden.float() / scale.float()).to(torch.float8_e4m3fn)
    return {"": quantised.cpu().contiguous(), ".scale": scale.cpu().contiguous()}


def restored(read, name: str) -> torch.Tensor:
    """The inverse of :func:`stored`: ``read(key)`` gives a tensor of the shard."""
    tensor = read(name)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.float() * read(name + ".scale").float()
    return tensor


def cache_dtype(name: str, target: Target) -> torch.dtype:
    """``auto`` is the target's own dtype: nothing is lost by storing its hidden states as they came."""
    return target.model.dtype if name == "auto" else DTYPES[name]


SETTINGS = "settings.json"  # what the shards in the folder were written for; a rerun with others starts over
MATCHED = "cache_from.json"  # {train row: the file of the speculators capture holding its token ids}


def cache_settings(target: Target, dataset, needs: TargetNeeds, *, split_fingerprint: str, dtype: torch.dtype,
                   rows_per_shard: int, layout: str = "drafttrain", cache_from: str | None = None) -> dict:
    """What a cache is written for. In speculators' layout (``layout``; always with ``cache_from``, a capture of
    speculators' the rows are matched to) ``layers`` lists the slots of a row's file, its last the final state
    before the norm."""
    top_k = needs.logits_top_k if needs.logits else None
    if cache_from and layout != "speculators":
        raise ValueError("a cache joining a capture of speculators' (cache_from) is in its layout")
    if layout == "speculators" and layout_refusal(needs):
        raise DrafttrainError(layout_refusal(needs))
    layers = slot_layers(needs, target.num_layers) if layout == "speculators" else needs.stored_layers(target.num_layers)
    return {"format_version": FORMAT_VERSION, "layout": layout,
            "cache_from": str(Path(cache_from).expanduser().resolve()) if cache_from else None,
            "target": target.name, "target_fingerprint": target.fingerprint,
            "layers": layers, "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size, "logits_top_k": top_k,
            "logits_temperature": needs.logits_temperature if top_k else None,
            "argmax": keeps_argmax(needs), "num_rows": len(dataset),
            "dtype": next(name for name, value in DTYPES.items() if value == dtype),
            "split_fingerprint": split_fingerprint,
            "rows_per_shard": rows_per_shard}


def keeps_argmax(needs: TargetNeeds) -> bool:
    """The cache keeps the full-vocabulary argmax whenever the logits are recomputed: prepare knows the kind's needs
    before any draft (or its draft vocabulary) exists, and 4 bytes a token is cheap beside the hidden states."""
    return bool(needs.logits) and needs.logits_top_k is None


def reads_argmax(needs: TargetNeeds, vocab_size: int) -> bool:
    """Training reads the cached argmax when its logits cover a draft vocabulary's rows only (fewer than the
    target's: over all of them, the argmax comes with the logits)."""
    rows = needs.logits_rows
    return keeps_argmax(needs) and rows is not None and rows.numel() < vocab_size


def start_cache(out_dir: str | Path, settings: dict, train=None) -> Path:
    """Keep the finished shards of an interrupted run with the same settings; anything else starts over (outputs
    written for other rows, another target or other layers would not line up). With ``cache_from``, give each row of
    ``train`` the capture's file holding its token ids (MATCHED). One process calls this."""
    out_dir = Path(out_dir)
    if out_dir.is_dir():
        try:
            same = read_json(out_dir / SETTINGS) == settings
        except DrafttrainError:
            same = False
        if not same:
            remove(out_dir, "an offline cache written with other settings", inside=out_dir, made=_is_cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / SETTINGS).is_file():
        write_text_atomic(out_dir / SETTINGS, json.dumps(settings, indent=1))
    if settings.get("cache_from"):
        matched, missing = match_rows(settings["cache_from"], train, settings["layers"], settings["hidden_size"])
        if missing:
            log.warning("%s", describe_missing(settings["cache_from"], missing, len(train)))
        write_text_atomic(out_dir / MATCHED, json.dumps(matched))
    return out_dir



def _matched(out_dir: Path, settings: dict) -> dict[int, str]:
    if not settings.get("cache_from"):
        return {}
    return {int(row): path for row, path in read_json(out_dir / MATCHED).items()}


def _is_cache(folder: Path) -> bool:
    """A folder start_cache made: it writes its settings first."""
    return (folder / SETTINGS).is_file()


def _shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def _finished(out_dir: Path, number: int) -> dict | None:
    """The record of a shard written completely (the record is written after its file, both atomically)."""
    record_path = out_dir / (_shard_name(number) + ".json")
    if not record_path.is_file():
        return None
    record = read_json(record_path)
    path = out_dir / record["file"]
    return record if path.is_file() and path.stat().st_size == record["bytes"] else None


@torch.no_grad()
def write_shards(source: TargetSource, num_rows: int, out_dir: str | Path, settings: dict, rank: int = 0,
                 world: int = 1, progress: bool = True, train=None) -> int:
    """Write this rank's shards (shard k holds rows [k·R, (k+1)·R) and belongs to rank k mod world) from what
    ``source`` computes of each row, skipping the ones a previous run finished. Each shard lands under a temporary
    name, is renamed, then gets its record: a process killed mid-way loses at most the shard it was writing. In
    speculators' layout each row gets its own file (``train``: the rows' token ids) or a matched capture's, and the
    shard keeps the rest (the argmax). Returns the number of shards written now."""
    out_dir, per_shard = Path(out_dir), settings["rows_per_shard"]
    rows_of = {k: list(range(k * per_shard, min((k + 1) * per_shard, num_rows)))
               for k in range(-(-num_rows // per_shard)) if k % world == rank and _finished(out_dir, k) is None}
    matched = _matched(out_dir, settings)
    source.ask(row for rows in rows_of.values() for row in rows if row not in matched)  # an engine has them ready
    bar = progress_bar(total=sum(map(len, rows_of.values())), desc=f"target features (rank {rank})", unit="row",
                       enabled=progress)
    files = _RowFiles(source, out_dir, settings, train, matched) if settings.get("layout") == "speculators" else None
    for k, rows in rows_of.items():
        if files is None:
            _write_shard(out_dir, k, _shard_of(source.states(rows), rows, DTYPES[settings["dtype"]], bar), rows)
        else:
            _write_shard(out_dir, k, *files.shard(rows, bar))
    bar.close()
    return len(rows_of)


def _shard_of(states: list[dict[str, torch.Tensor]], rows: list[int], dtype: torch.dtype, bar) -> dict:
    """drafttrain's layout: every entry of every row in the shard, hidden states in the cache's dtype."""
    shard: dict[str, torch.Tensor] = {}
    for row, entries in zip(rows, states):
        for name, tensor in entries.items():
            kept = stored(tensor, dtype) if name.startswith("layer") else {"": tensor.cpu().contiguous()}
            shard.update({f"row{row}.{name}{suffix}": value for suffix, value in kept.items()})
        bar.update(1)
    return shard


class _RowFiles:
    """Shards in speculators' layout: each row's states in a file of its own (written from the source's entries, or
    the file of speculators' capture holding its tokens), the shard keeping its argmax."""

    def __init__(self, source: TargetSource, out_dir: Path, settings: dict, train, matched: dict[int, str]):
        if train is None:
            raise ValueError("speculators' layout writes each row's token ids: pass the rows (train)")
        self.source, self.out_dir, self.settings, self.train, self.matched = source, out_dir, settings, train, matched

    def shard(self, rows: list[int], bar) -> tuple[dict, list[int], list[dict]]:
        """(the shard's tensors, its rows, each row's file record)."""
        computed = [row for row in rows if row not in self.matched]
        states = dict(zip(computed, self.source.states(computed)))
        shard, files = {}, []
        for row in rows:
            ids = self.train[row]["input_ids"]
            name, entries = self._written(row, ids, states[row]) if row in states else self._from_capture(row, ids)
            if self.settings["argmax"]:
                shard[f"row{row}.argmax"] = entries["argmax"].contiguous()
            files.append({"file": name, "sha256": file_sha256(self.out_dir / name)})
            bar.update(1)
        return shard, rows, files

    def _written(self, row: int, ids: list[int], entries: dict) -> tuple[str, dict]:
        target = self.source.target
        return write_row(self.out_dir, row, ids, entries, self.settings["layers"], target.num_layers,
                         DTYPES[self.settings["dtype"]]), entries

    def _from_capture(self, row: int, ids: list[int]) -> tuple[str, dict]:
        """The capture's file for the row (checked to hold its tokens), and its argmax from its final state."""
        name, target = self.matched[row], self.source.target
        tokens, hidden = read_row(Path(name))
        check_match(name, row, ids, tokens)
        if not self.settings["argmax"]:
            return name, {}
        final = states_of_slots(hidden, self.settings["layers"], target)[f"layer{target.num_layers}"]
        return name, {"argmax": argmax_entry(target, final)}


def _write_shard(out_dir: Path, number: int, shard: dict[str, torch.Tensor], rows: list[int],
                 row_files: list[dict] | None = None) -> None:
    name = _shard_name(number)
    save_file(shard, str(out_dir / (name + ".tmp")))
    os.replace(out_dir / (name + ".tmp"), out_dir / name)
    record = {"file": name, "sha256": file_sha256(out_dir / name), "rows": rows, "bytes": (out_dir / name).stat().st_size}
    if row_files is not None:
        record["row_files"] = row_files
    write_text_atomic(out_dir / (name + ".json"), json.dumps(record))


def join_shards(out_dir: str | Path, train=None) -> Path:
    """index.json: the settings and every shard's record, once all ranks are done (one process calls this). In
    speculators' layout written whole here (no ``cache_from``), ``train`` beside the files as its prepared dataset."""
    out_dir = Path(out_dir)
    settings = read_json(out_dir / SETTINGS)
    count = -(-settings["num_rows"] // settings["rows_per_shard"])
    records = [_finished(out_dir, k) for k in range(count)]
    missing = [_shard_name(k) for k, r in enumerate(records) if r is None]
    if missing:
        raise DrafttrainError(f"feature cache {out_dir}: {len(missing)} of {count} shards are not written "
                              f"({', '.join(missing[:3])}...): rerun `drafttrain prepare` to write only those")
    index = {**settings, "shards": [{k: r[k] for k in ("file", "sha256", "rows", "row_files") if k in r}
                                    for r in records]}
    if settings.get("layout") == "speculators" and not settings.get("cache_from"):
        write_prepared_dataset(train, out_dir)
    write_text_atomic(out_dir / INDEX, json.dumps(index, indent=1))
    return out_dir


def write_feature_cache(target: Target, dataset, needs: TargetNeeds, out_dir: str | Path, *, split_fingerprint: str,
                        dtype: torch.dtype, rows_per_shard: int = 256, progress: bool = True,
                        source: TargetSource | None = None, layout: str = "drafttrain",
                        cache_from: str | None = None) -> Path:
    """Store what ``needs`` asks for of every row of a tokenised split, computed by ``source`` (default: the target's
    HF forward in this process; in speculators' layout one made with ``prenorm``), in one process (see the module
    doc; ``drafttrain prepare`` under a launcher splits the shards over its processes)."""
    settings = cache_settings(target, dataset, needs, split_fingerprint=split_fingerprint, dtype=dtype,
                              rows_per_shard=rows_per_shard, layout=layout, cache_from=cache_from)
    start_cache(out_dir, settings, dataset)
    source = source or HFForward(target, needs, dataset, cache_argmax=settings["argmax"],
                                 prenorm=settings["layout"] == "speculators")
    write_shards(source, len(dataset), out_dir, settings, progress=progress, train=dataset)
    return join_shards(out_dir, dataset)


class FeatureCache(TargetSource):
    """Streams the target outputs of given rows from the cache (memory-mapped shards, verified once each)."""

    name = "offline cache"

    def __init__(self, directory: str | Path, target: Target, needs: TargetNeeds, split_fingerprint: str):
        super().__init__(target, needs)
        self.directory = Path(directory)
        path = self.directory / INDEX
        if not path.is_file():
            raise DrafttrainError(f"no feature cache at {self.directory} ({INDEX} missing): run `drafttrain prepare` "
                                  "with training.hidden_states: offline")
        self.index = read_json(path)
        try:
            self._check(split_fingerprint)
            self._row_shard = {r: s["file"] for s in self.index["shards"] for r in s["rows"]}
            # speculators' layout: each row's own file (relative to the cache, or a capture's elsewhere) and sha256
            self._row_file = {r: (f["file"], f["sha256"]) for s in self.index["shards"]
                              for r, f in zip(s["rows"], s.get("row_files", ()))}
        except (KeyError, TypeError) as err:
            raise damaged(path, f"lacks or garbles its {err} entry") from None
        self._verified: set[str] = set()
        # With the cached argmax and a plain linear head, training computes the draft vocabulary's rows of the
        # logits alone (gathered here, once). Caches written before the argmax was kept go through the full head.
        self._rows_weight = plain_rows(target.model, needs.logits_rows) \
            if self.index.get("argmax") and reads_argmax(needs, target.vocab_size) else None

    def _check(self, split_fingerprint: str) -> None:
        index, where = self.index, f"feature cache {self.directory}"
        rerun = "rerun `drafttrain prepare` to rebuild it"
        if index.get("format_version") != FORMAT_VERSION:
            raise DrafttrainError(f"{where} was written by another drafttrain version; {rerun}")
        if index["hidden_size"] != self.target.hidden_size:
            raise DrafttrainError(f"{where} has hidden size {index['hidden_size']}, the target has "
                                  f"{self.target.hidden_size}: it was written for another target; {rerun}")
        if index["target_fingerprint"] != self.target.fingerprint:
            raise DrafttrainError(f"{where} holds the outputs of another target ({index['target']}, fingerprint "
                                  f"{index['target_fingerprint']}; this one is {self.target.fingerprint}); {rerun}")
        if self.needs.logits and self.needs.logits_top_k is not None:
            wanted = (self.needs.logits_top_k, self.needs.logits_temperature, self.target.vocab_size)
            found = (index.get("logits_top_k"), index.get("logits_temperature"), index.get("vocab_size"))
            if wanted != found:
                raise DrafttrainError(f"{where} holds the teacher's top-{found[0]} at temperature {found[1]} over a "
                                      f"vocabulary of {found[2]}; the recipe asks top-{wanted[0]} at {wanted[1]} over "
                                      f"{wanted[2]}; {rerun}")
        missing = [layer for layer in self.needs.stored_layers(self.target.num_layers) if layer not in index["layers"]]
        if missing:
            raise DrafttrainError(f"{where} holds layers {index['layers']}, the draft needs {missing} too; {rerun}")
        if index["split_fingerprint"] != split_fingerprint:
            raise DrafttrainError(f"{where} was built from other training rows (split {index['split_fingerprint']}, "
                                  f"now {split_fingerprint}): it is stale; {rerun}")

    def _verify(self, name: str, expected: str) -> Path:
        """The path of a file of the cache, its sha256 checked the first time it is read."""
        path = self.directory / name
        if name not in self._verified:
            if not path.is_file() or file_sha256(path) != expected:
                raise damaged(path, "is missing or does not match its sha256 in index.json")
            self._verified.add(name)
        return path

    def _open(self, name: str):
        expected = next(s["sha256"] for s in self.index["shards"] if s["file"] == name)
        return safe_open(str(self._verify(name, expected)), framework="pt")

    def _row(self, row: int, names: list[str]) -> list[torch.Tensor]:
        if row not in self._row_shard:
            raise DrafttrainError(f"feature cache {self.directory} has no row {row}")
        if row in self._row_file:
            return self._row_of_file(row, names)
        with self._open(self._row_shard[row]) as f:
            return [restored(f.get_tensor, f"row{row}.{name}") for name in names]

    def _row_of_file(self, row: int, names: list[str]) -> list[torch.Tensor]:
        """A row in speculators' layout: its states from its file (the final one normed here), the rest from its
        shard."""
        _, hidden = read_row(self._verify(*self._row_file[row]))
        entries = states_of_slots(hidden, self.index["layers"], self.target)
        rest = [name for name in names if name not in entries]
        if rest:
            with self._open(self._row_shard[row]) as f:
                entries.update({name: f.get_tensor(f"row{row}.{name}") for name in rest})
        return [entries[name] for name in names]

    @torch.no_grad()
    def outputs(self, batch: dict[str, torch.Tensor]) -> TargetOutputs:
        """Right-padded outputs for the batch's rows (``row_index``), in the target's dtype, on its device."""
        names = cached_names(self.needs, self.target.num_layers, argmax=self._rows_weight is not None)
        per_row = [dict(zip(names, self._row(int(r), names))) for r in batch[ROW_INDEX].tolist()]
        return assemble(per_row, batch["input_ids"].shape[1], self.target, self.needs, self._rows_weight)
