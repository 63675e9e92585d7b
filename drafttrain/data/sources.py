"""Mix several sources into one deduplicated, shuffled train/validation split.

Order of operations: load every source -> drop duplicates (first occurrence wins, in recipe order) -> cap each source
at ``max_samples`` -> share ``num_samples`` out by weight -> shuffle -> split off validation.

Determinism: a conversation's place in the shuffle is ``sha256(seed, content hash, id)``, so it depends on the seed
and on the conversation only -- not on the order the sources are listed in, file-system order, or Python's
per-process hash randomisation. Each source contributes its first ``n`` conversations in that order, so asking for more
samples extends the selection instead of redrawing it.

Shares: ``num_samples * weight / sum(weights)``, rounded by largest remainder. A source that has fewer conversations
than its share gives the rest to the other sources in proportion to their weights (``num_samples`` is the total the
recipe asked for); ``stats['sources'][name]['short_by']`` records how much it lacked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig
from drafttrain.data.conversations import LoadedSource, conversation_hash, load_conversations, source_name
from drafttrain.data.traffic import traffic_source

TRAFFIC_FORMATS = ("request_log", "prompts")

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Mixture:
    train: list[dict]
    validation: list[dict]
    # {"sources": {name: {path, records, loaded, skipped: {reason: n}, duplicates, available, taken, short_by}},
    #  "deduped": n, "train": n, "validation": n, "prompt_only": n, "seed": seed}
    stats: dict

    def summary(self) -> str:
        return format_mixture_stats(self.stats)


def _shuffle_key(seed: int, conversation: dict) -> str:
    return hashlib.sha256(f"{seed}\0{conversation['_hash']}\0{conversation['id']}".encode()).hexdigest()


def allocate(total: int, weights: list[float], available: list[int]) -> list[int]:
    """Split ``total`` by weight, capped by what each source has; leftovers go to sources that still have data."""
    taken = [0] * len(weights)
    remaining = min(total, sum(available))
    open_ = [i for i, a in enumerate(available) if a > 0]
    while remaining > 0 and open_:
        wsum = sum(weights[i] for i in open_)
        raw = {i: remaining * weights[i] / wsum for i in open_}
        share = {i: int(raw[i]) for i in open_}
        # Largest remainder (ties by source order) so the shares add up exactly.
        for i in sorted(open_, key=lambda i: (-(raw[i] - share[i]), i))[: remaining - sum(share.values())]:
            share[i] += 1
        for i in open_:
            give = min(share[i], available[i] - taken[i])
            taken[i] += give
            remaining -= give
        open_ = [i for i in open_ if taken[i] < available[i]]
    return taken


def _unique_names(data_cfg: DataConfig) -> list[str]:
    names, seen = [], Counter()
    for src in data_cfg.sources:
        base = source_name(src.path)
        seen[base] += 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def _load_source(src, name: str) -> tuple[LoadedSource, dict[str, int]]:
    """One source's conversations, and for served traffic the secrets replaced in it (by kind); the lines a log
    could not use are named in the log (the first few) and counted."""
    if src.format not in TRAFFIC_FORMATS:
        return load_conversations(src.path, src.format, name=name, split=src.split, subset=src.subset), {}
    loaded, read = traffic_source(src.path, src.format, name, src.rejected_weight)
    for line in read.skipped[:5]:
        log.warning("%s: skipped %s", src.path, line)
    if len(read.skipped) > 5:
        log.warning("%s: %d more lines skipped (counted in the summary)", src.path, len(read.skipped) - 5)
    if read.redacted:
        log.warning("%s: secret-looking strings replaced by [REDACTED] before anything was stored: %s", src.path,
                    ", ".join(f"{kind} {n}" for kind, n in sorted(read.redacted.items())))
    return loaded, dict(read.redacted)


def load_mixture(data_cfg: DataConfig, seed: int) -> Mixture:
    """Load, dedupe, weight, shuffle and split the recipe's data sources (see the module docstring)."""
    names = _unique_names(data_cfg)
    per_source: list[list[dict]] = []
    stats: dict = {"sources": {}, "deduped": 0, "seed": seed}
    seen_hashes: set[str] = set()
    for src, name in zip(data_cfg.sources, names):
        loaded, redacted = _load_source(src, name)
        kept, duplicates = [], 0
        for conv in loaded.conversations:
            conv["_hash"] = conversation_hash(conv)
            if data_cfg.dedupe and conv["_hash"] in seen_hashes:
                duplicates += 1
                continue
            seen_hashes.add(conv["_hash"])
            kept.append(conv)
        kept.sort(key=lambda c: _shuffle_key(seed, c))
        if src.max_samples is not None:
            kept = kept[: src.max_samples]
        per_source.append(kept)
        stats["deduped"] += duplicates
        stats["sources"][name] = {
            "path": src.path,
            "records": loaded.records,
            "loaded": len(loaded.conversations),
            "skipped": dict(loaded.skipped),
            "duplicates": duplicates,
            "available": len(kept),
            **({"redacted": redacted} if redacted else {}),
        }

    available = [len(convs) for convs in per_source]
    total = data_cfg.num_samples if data_cfg.num_samples is not None else sum(available)
    taken = allocate(total, [s.weight for s in data_cfg.sources], available)
    wsum = sum(s.weight for s in data_cfg.sources)
    chosen: list[dict] = []
    for name, src, convs, n in zip(names, data_cfg.sources, per_source, taken):
        chosen += convs[:n]
        wanted = round(total * src.weight / wsum) if data_cfg.num_samples is not None else len(convs)
        stats["sources"][name].update(taken=n, short_by=max(0, wanted - n))
    if not chosen:
        raise DrafttrainError(
            "the data mixture is empty after filtering: " + "; ".join(
                f"{name}: {s['loaded']} loaded, skipped {s['skipped'] or 'none'}, {s['duplicates']} duplicates"
                for name, s in stats["sources"].items()
            )
        )

    chosen.sort(key=lambda c: _shuffle_key(seed, c))
    for conv in chosen:
        del conv["_hash"]
    n_val = validation_size(len(chosen), data_cfg.validation_fraction)
    validation, train = chosen[:n_val], chosen[n_val:]
    stats.update(train=len(train), validation=len(validation), prompt_only=sum(c["needs_response"] for c in chosen))
    if data_cfg.num_samples is not None and len(chosen) < data_cfg.num_samples:
        log.warning("data: asked for %d conversations, only %d available", data_cfg.num_samples, len(chosen))
    return Mixture(train=train, validation=validation, stats=stats)


def validation_size(n: int, fraction: float) -> int:
    """round(n * fraction), but at least one when a fraction is asked for and the split can leave training data."""
    if fraction <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * fraction)))


def format_mixture_stats(stats: dict) -> str:
    lines = [f"data mixture (seed {stats['seed']}): {stats['train']} train, {stats['validation']} validation, "
             f"{stats['prompt_only']} prompt-only (need responses), {stats['deduped']} duplicates dropped"]
    for name, s in stats["sources"].items():
        skipped = ", ".join(f"{reason}: {n}" for reason, n in sorted(s["skipped"].items())) or "none"
        short = f", short by {s['short_by']}" if s.get("short_by") else ""
        lines.append(f"  {name}: {s['loaded']} loaded from {s['records']} records, took {s['taken']}{short}; "
                     f"duplicates {s['duplicates']}; skipped: {skipped}")
    return "\n".join(lines)
