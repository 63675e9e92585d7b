"""Replay: rows of an earlier run's train split mixed into a new one (``data.replay``), so that a draft continued on
new data (``draft.init_from``) keeps what it learnt on the old.

The rows are taken as that run tokenised them (nothing is re-answered or re-tokenised), so they must come from the
same tokenizer, which its data manifest records; its split must still hash to what the manifest says. Rows longer
than this recipe's ``max_length`` are left out (counted). Which rows: a shuffle fixed by the seed, so a rerun
replays the same ones.
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset, concatenate_datasets

from drafttrain import DrafttrainError
from drafttrain.config import ReplayConfig
from drafttrain.data.tokenize import split_fingerprint
from drafttrain.runfolder import DataManifest, RunFolder, damaged, open_dataset


def replay_count(new_rows: int, fraction: float) -> int:
    """Rows to replay so that they make up ``fraction`` of the final split."""
    return round(new_rows * fraction / (1 - fraction))


def _row_keys(dataset: Dataset | None) -> set[bytes]:
    return {np.asarray(ids, dtype=np.int64).tobytes() for ids in dataset["input_ids"]} if dataset is not None else set()


def with_replay(train: Dataset, replay: ReplayConfig, tokenizer_id: str | None, max_length: int, seed: int,
                validation: Dataset | None = None) -> tuple[Dataset, dict]:
    """``train`` with the replayed rows appended, and what was replayed (the run, its split's fingerprint, the
    rows asked for and taken, those too long, those already in this run: a row of the new validation split must
    not be trained on, and one already in the train split would count twice)."""
    run = RunFolder.of(replay.run)
    if not run.data_manifest.is_file():
        raise DrafttrainError(f"data.replay.run {replay.run}: no prepared data there ({run.data_manifest} is "
                              "missing): name the output_dir of the run whose data the draft was trained on")
    manifest = DataManifest.read(run)
    if manifest.tokenizer and tokenizer_id and manifest.tokenizer != tokenizer_id:
        raise DrafttrainError(f"data.replay.run {replay.run} was tokenised by another tokenizer (its target: "
                              f"{manifest.target}) than this run's target: its token ids would mean other tokens")
    old = open_dataset(run.train_split)
    fingerprint = split_fingerprint(old)
    if fingerprint != manifest.train:
        raise damaged(run.train_split, f"does not hash to the fingerprint recorded in {run.data_manifest}")
    if set(old.column_names) != set(train.column_names):
        raise DrafttrainError(f"data.replay.run {replay.run}: its rows have columns {sorted(old.column_names)}, "
                              f"this run's {sorted(train.column_names)} (one of them packs rows: set data.packing "
                              "alike)")
    present = _row_keys(train) | _row_keys(validation)
    fitting = [i for i, n in enumerate(old["num_tokens"]) if n <= max_length]
    fresh = [i for i, ids in zip(fitting, old.select(fitting)["input_ids"])
             if np.asarray(ids, dtype=np.int64).tobytes() not in present]
    asked = replay_count(len(train), replay.fraction)
    chosen = sorted(np.random.default_rng(seed).permutation(fresh)[:asked].tolist())
    stats = {"run": str(run.root), "split_fingerprint": fingerprint, "asked": asked, "rows": len(chosen),
             "too_long": len(old) - len(fitting), "already_here": len(fitting) - len(fresh)}
    if not chosen:
        raise DrafttrainError(f"data.replay.run {replay.run}: nothing to replay of its {len(old)} rows: "
                              + _why_none(stats, max_length))
    replayed = old.select(chosen).cast(train.features)
    return concatenate_datasets([train, replayed]), stats


def _why_none(stats: dict, max_length: int) -> str:
    """Why no row of the earlier run is replayed, naming each cause that applies (a row too long for
    data.max_length, a row this run already holds)."""
    causes = []
    if stats["too_long"]:
        causes.append(f"{stats['too_long']} are longer than data.max_length {max_length}")
    if stats["already_here"]:
        causes.append(f"{stats['already_here']} are already in this run's data (replay adds only rows it lacks)")
    return " and ".join(causes) or "data.replay.fraction asks for none"
