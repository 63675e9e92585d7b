"""The data pipeline behind ``drafttrain prepare``: recipe -> mixture -> (regenerated answers) -> tokenised
datasets -> draft vocab -> (offline target outputs) -> :class:`PrepareSummary`.

Outputs in the run folder (drafttrain.runfolder):
  * ``regenerated.jsonl`` (+ ``.settings.json``, ``.dropped.jsonl``) when ``regenerate.enabled``; resumable;
  * ``data/train`` and ``data/validation``: ``datasets.save_to_disk`` folders (columns from
    :func:`drafttrain.data.tokenize.build_tokenized_dataset`), and ``data/validation_prompts.jsonl``: the
    validation conversations' first user turns, on which checkpoints are chosen;
  * ``draft_vocab.safetensors`` when ``draft_vocab.enabled`` (see :mod:`drafttrain.data.vocab`);
  * ``features/`` when ``training.hidden_states: offline``: what the draft kind needs from the target (in
    speculators' layout with ``training.cache_layout: speculators``, over a capture of speculators' with
    ``training.cache_from``: drafttrain.sources.speculators);
  * ``prepare_summary.json``: every count (per source, regenerated, tokens, each skip reason, coverage).

The recipe is validated in full before any work starts, and so are the things that would fail late (missing data
files, a draft vocab larger than the target's vocabulary), so a typo never costs an hour of generation.
Relative data paths resolve against the current working directory (not the recipe's folder).

Why training/ and not data/: besides data/ and targets/, the pipeline asks drafts/ (which vocabulary a kind
allows, a continued draft's saved token ids, what the kind needs from the target) and writes the offline cache
with :mod:`drafttrain.sources.cache`. training/ is the lowest layer that may import all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig, Recipe
from drafttrain.data.regenerate import regenerate_conversations
from drafttrain.data.replay import with_replay
from drafttrain.data.sources import load_mixture
from drafttrain.data.tokenize import (
    build_tokenized_dataset,
    describe_run_data,
    split_fingerprint,
    tokenizer_fingerprint,
)
from drafttrain.data.traffic import ANSWER_WEIGHTS, redacted
from drafttrain.data.vocab import DraftVocabKey, build_draft_vocab, dataset_coverage, save_draft_vocab
from drafttrain.drafts.continuation import check_vocabulary_choice, run_target_needs
from drafttrain.drafts.saved import saved_draft_ids
from drafttrain.runfolder import DataManifest, RunFolder, RunLock, open_dataset, write_text_atomic
from drafttrain.sources.cache import (
    cache_dtype,
    cache_settings,
    join_shards,
    keeps_argmax,
    start_cache,
    write_feature_cache,
    write_shards,
)
from drafttrain.sources.choose import cache_sources, caches_held_out, process_target
from drafttrain.sources.speculators import capture_files, layout_refusal
from drafttrain.targets import Target, load_target, load_tokenizer
from drafttrain.targets.loading import checked_model_dir, missing_model_message, target_name
from drafttrain.targets.partial import load_shape
from drafttrain.userfiles import remove, writing

log = logging.getLogger(__name__)

DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".gz", ".csv", ".txt")
# After a write that failed (a full disk, a file-size limit, a read-only folder): what is intact, how to go on
_AFTER_FAILED_WRITE = ("; what an earlier prepare left whole is kept as it was: make room (or a writable output_dir) "
                       "and rerun `drafttrain prepare` (answers already regenerated are reused)")


# --------------------------------------------------------------------------------------------------------------
# Summary (field order is the key order of prepare_summary.json)


@dataclasses.dataclass(frozen=True)
class SourceSummary:
    path: str
    records: int
    loaded: int
    taken: int
    regenerated: int | None  # None when the target does not re-answer this source
    tokenized_conversations: int


@dataclasses.dataclass(frozen=True)
class MixtureSummary:
    train: int
    validation: int
    prompt_only: int
    duplicates_dropped: int


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    path: str | None  # None when the split has no rows
    rows: int
    conversations_in: int
    conversations_tokenized: int
    tokens: int
    trainable_tokens: int
    cache_hit: bool | None
    feedback: dict[str, int] | None  # what evaluation feedback weighted (drafttrain.data.tokenize)


@dataclasses.dataclass(frozen=True)
class DatasetsSummary:
    train: SplitSummary
    validation: SplitSummary


@dataclasses.dataclass(frozen=True)
class SkippedSummary:
    """{reason: count} per stage."""

    load: dict[str, int]
    dedupe: dict[str, int]
    regenerate: dict[str, int]
    tokenize_train: dict[str, int]
    tokenize_validation: dict[str, int]


@dataclasses.dataclass(frozen=True)
class PrepareSummary:
    """Every count of a prepare run; :meth:`to_json` is ``prepare_summary.json``."""

    output_dir: str
    target: str
    seed: int
    sources: dict[str, SourceSummary]
    mixture: MixtureSummary
    regenerate: dict[str, Any] | None  # drafttrain.data.regenerate's stats; None when regenerate is disabled
    datasets: DatasetsSummary
    skipped: SkippedSummary
    replay: dict[str, Any] | None  # rows of an earlier run appended to the train split (data.replay)
    draft_vocab: dict[str, Any] | None  # None when draft_vocab is disabled
    seconds: dict[str, float]  # per stage
    recipe: dict[str, Any]

    @property
    def summary(self) -> dict[str, Any]:
        """Plain JSON values, as ``prepare_summary.json`` holds them."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.summary, indent=2) + "\n"

    @property
    def run(self) -> RunFolder:
        return RunFolder.of(self.output_dir)

    @property
    def train_rows(self) -> int:
        return self.datasets.train.rows

    @property
    def validation_rows(self) -> int:  # 0 when there is no validation split
        return self.datasets.validation.rows

    @property
    def draft_vocab_path(self) -> Path | None:
        return Path(self.draft_vocab["path"]) if self.draft_vocab else None

    @property
    def regenerated_path(self) -> Path | None:
        return Path(self.regenerate["path"]) if self.regenerate else None


# --------------------------------------------------------------------------------------------------------------
# Early checks (before any expensive work)


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or path.lower().endswith(DATA_FILE_SUFFIXES)


def local_sources(data: DataConfig) -> list[tuple[str, Path]]:
    """(recipe key, path) of every local file the data section reads."""
    return [(f"data.sources.{index}.path", Path(source.path).expanduser())
            for index, source in enumerate(data.sources) if _looks_local(source.path)]


def check_data_files(data: DataConfig) -> None:
    """Every local source file exists; the error names the recipe field and how the path was resolved."""
    for index, source in enumerate(data.sources):
        path = Path(source.path).expanduser()
        if _looks_local(source.path) and not path.exists():
            raise DrafttrainError(
                f"data.sources.{index}.path: file not found: {source.path} (relative paths resolve against the "
                f"current directory, {Path.cwd()} -> {path.resolve()})"
            )


def target_vocab_size_from_config(recipe: Recipe) -> int:
    """The target's vocabulary size (lm_head rows) from its config, without loading the weights."""
    target = recipe.target
    where = checked_model_dir(target, weights_required=False)
    try:
        config = AutoConfig.from_pretrained(where, revision=target.revision, trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError) as err:  # not built in, no folder, not in the offline cache (huggingface_hub)
        raise DrafttrainError(missing_model_message(target.model, err)) from None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


def check_draft_vocab_size(recipe: Recipe, vocab_size: int) -> None:
    if recipe.draft_vocab.enabled and recipe.draft_vocab.size > vocab_size:
        raise DrafttrainError(
            f"draft_vocab.size {recipe.draft_vocab.size} is larger than the target vocabulary ({vocab_size} tokens "
            f"of {recipe.target.model}); use at most {vocab_size}"
        )


# --------------------------------------------------------------------------------------------------------------
# Steps


def _with_limit(data: DataConfig, limit: int | None) -> DataConfig:
    """``--limit N`` caps the number of conversations taken from the mixture (weights still apply)."""
    if limit is None:
        return data
    if limit <= 0:
        raise DrafttrainError(f"--limit must be positive, got {limit}")
    num = limit if data.num_samples is None else min(data.num_samples, limit)
    return data.model_copy(update={"num_samples": num})


def _regenerate(recipe: Recipe, mixture, target: Target, run: RunFolder, progress: bool):

    kept_sources = {name for name, yes in _regenerated_sources(recipe, mixture).items() if not yes}
    # served traffic whose logged answer the target itself gave is kept as it is: it is already the target's own
    own = {target_name(recipe.target), recipe.regenerate.served_model} - {None}
    kept = {str(c["id"]) for c in mixture.train + mixture.validation
            if c["source"] in kept_sources or c.get("answered_by") in own}
    todo = [c for c in mixture.train + mixture.validation if str(c["id"]) not in kept]
    _warn_lost_feedback(todo, own)
    result = regenerate_conversations(
        todo,
        recipe.regenerate,
        run.regenerated,
        seed=recipe.seed,
        target=target,
        target_name=target_name(recipe.target),  # a fine-tune (target.adapter) is another model than its base
        progress=progress,
    )
    by_id = {str(c["id"]): c for c in result.conversations}
    by_id.update((str(c["id"]), c) for c in mixture.train + mixture.validation if str(c["id"]) in kept)
    train = [by_id[str(c["id"])] for c in mixture.train if str(c["id"]) in by_id]
    validation = [by_id[str(c["id"])] for c in mixture.validation if str(c["id"]) in by_id]
    if not train:
        raise DrafttrainError(
            f"every training conversation was dropped during regeneration ({_reasons(result.dropped)}); "
            "check regenerate.max_new_tokens and the target's chat template, or set regenerate.keep_original_on_empty"
        )
    return train, validation, result


def _warn_lost_feedback(todo: list[dict], own: set[str]) -> None:
    """Evaluation feedback is about the answer it logged: re-answered, it is dropped. Say so (a target named
    otherwise in the evaluation than in the recipe is the usual cause), rather than train unweighted unnoticed."""
    lost = Counter(str(c.get("answered_by")) for c in todo if c.get(ANSWER_WEIGHTS))
    for model, n in lost.items():
        log.warning("%d answers with evaluation feedback were logged by %r, not by this recipe's target (%s): the "
                    "target answers them again and their feedback is dropped; name the target as the evaluation did",
                    n, model, " or ".join(sorted(own)))


def _tokenize_split(name: str, conversations: list[dict], tokenizer, data: DataConfig, cache_dir: Path, required: bool):
    """(dataset or None, stats). An untokenisable validation split is reported, not fatal; the train split is."""
    if not conversations:
        return None, {"conversations": 0, "rows": 0, "tokens": 0, "trainable_tokens": 0, "skipped": {}}
    try:
        return build_tokenized_dataset(conversations, tokenizer, data, cache_dir)
    except DrafttrainError as err:
        if required:
            raise DrafttrainError(f"{name} split: {err}") from None
        log.warning("%s split: %s; continuing without it", name, err)
        return None, {"conversations": len(conversations), "rows": 0, "tokens": 0, "trainable_tokens": 0,
                      "skipped": {}, "error": str(err)}


def save_dataset(dataset, path: Path, run: RunFolder) -> None:
    """save_to_disk via a temporary folder, so an interrupted or failed save never leaves a half dataset in place
    (the earlier split stays whole until the new one is)."""
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp, "a split an interrupted prepare left half saved")
    path.parent.mkdir(parents=True, exist_ok=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per split for a copy that takes milliseconds is noise
    with writing(path, "the tokenised split", after=_AFTER_FAILED_WRITE):
        try:
            dataset.save_to_disk(str(tmp))
        except BaseException:
            remove(tmp, "the half-saved split of this failed save")
            raise
        finally:
            if bars:
                datasets.enable_progress_bars()
    run.remove(path, "the split an earlier prepare wrote")
    os.replace(tmp, path)


def _build_vocab(recipe: Recipe, train: tuple, validation_ds, tokenizer: tuple, vocab_size: int,
                 run: RunFolder) -> dict:
    """``train``: (the split, its fingerprint); ``tokenizer``: (the tokenizer, its fingerprint)."""
    (train_ds, fingerprint), (tokenizer, tokenizer_id) = train, tokenizer
    # a continued draft keeps its own tokens and gains those of the new data it lacks
    keep = saved_draft_ids(recipe.draft.init_from) if recipe.draft is not None and recipe.draft.init_from else None
    vocab = build_draft_vocab(train_ds, tokenizer, vocab_size, recipe.draft_vocab.size, recipe.draft_vocab.coverage,
                              key=DraftVocabKey(fingerprint, tokenizer_id), keep=keep)
    with writing(run.draft_vocab, "the draft vocabulary", after=_AFTER_FAILED_WRITE):
        save_draft_vocab(vocab, run.draft_vocab)
    info = vocab.summary()
    info["path"] = str(run.draft_vocab)
    has_validation = validation_ds is not None
    info["coverage_validation"] = round(dataset_coverage(validation_ds, vocab), 6) if has_validation else None
    return info


def _write_splits(recipe: Recipe, data: DataConfig, conversations: tuple, tokenizer: tuple, run: RunFolder):
    """Tokenise the (train, validation) ``conversations`` with ``tokenizer`` (the tokenizer, its fingerprint) into
    the run folder, with the held-out prompts and the data manifest. Returns ((train split, stats), (validation
    split or None, stats))."""
    (train, validation), (tokenizer, tokenizer_id) = conversations, tokenizer
    cache_dir = run.data_cache(data.cache_dir)
    train_ds, train_stats = _tokenize_split("train", train, tokenizer, data, cache_dir, required=True)
    # held-out rows stay unweighted (weight 1): their loss and accuracy measure the draft, not the feedback's
    # emphasis; the feedback's token ids still say where a cut answer ends
    validation = [dict(c, **{ANSWER_WEIGHTS: dict(c[ANSWER_WEIGHTS], rejected_weight=1)}) if c.get(ANSWER_WEIGHTS)
                  else c for c in validation]
    val_ds, val_stats = _tokenize_split("validation", validation, tokenizer, data, cache_dir, required=False)
    if data.replay is not None:  # an earlier run's rows, so a continued draft keeps what it learnt there
        train_ds, train_stats["replay"] = with_replay(train_ds, data.replay, tokenizer_id, data.max_length,
                                                      recipe.seed, validation=val_ds)
        train_stats["fingerprint"] = split_fingerprint(train_ds)
    save_dataset(train_ds, run.train_split, run)
    if val_ds is not None:
        save_dataset(val_ds, run.validation_split, run)
    else:
        run.remove(run.validation_split, "the validation split an earlier prepare wrote (this one has none)")
    write_validation_prompts(validation if val_ds is not None else [], run)
    with writing(run.data_manifest, "the data manifest", after=_AFTER_FAILED_WRITE):
        describe_run_data(run, train_stats["fingerprint"], val_ds, tokenizer_id, target_name(recipe.target)).write(run)
    return (train_ds, train_stats), (val_ds, val_stats)


def _warn_unanswered(recipe: Recipe, mixture) -> None:
    unanswered = _unanswered_per_source(recipe, mixture)
    if unanswered:
        log.warning("prompt-only conversations have no answer to train on and will be skipped (%s); let the target "
                    "answer them with regenerate.enabled=true and no 'regenerate: false' on their source",
                    ", ".join(f"{name}: {n}" for name, n in unanswered.items()))


def _regenerated_sources(recipe: Recipe, mixture) -> dict[str, bool]:
    """{source name: whether the target re-answers it}; the mixture's stats list the sources in recipe order."""
    return dict(zip(mixture.stats["sources"], map(recipe.regenerates, recipe.data.sources)))


def _unanswered_per_source(recipe: Recipe, mixture) -> dict[str, int]:
    regenerates = _regenerated_sources(recipe, mixture)
    return dict(Counter(c["source"] for c in mixture.train + mixture.validation
                        if c["needs_response"] and not regenerates[c["source"]]))


def write_validation_prompts(conversations: list[dict], run: RunFolder) -> None:
    """The validation conversations' first user turns as a FastChat question file: the held-out prompts on which
    every checkpoint's real τ is measured (and the best checkpoint chosen)."""
    path = run.validation_prompts
    lines = []
    for conversation in conversations:
        first = next((m["content"] for m in conversation["messages"] if m["role"] == "user"), None)
        if first and first.strip():
            lines.append(json.dumps({"question_id": str(conversation["id"]), "category": conversation["source"],
                                     "turns": [first]}, ensure_ascii=False))
    if lines:
        with writing(path, "the held-out prompts", after=_AFTER_FAILED_WRITE):
            write_text_atomic(path, "\n".join(lines) + "\n")
    else:
        run.remove(path, "the held-out prompts an earlier prepare wrote (this one has no validation split)")


def _write_features(recipe: Recipe, target: Target, train: tuple, run: RunFolder, progress: bool = True,
                    validation=None) -> None:
    """Offline target outputs: the target's outputs over the train split (``train``: the split and its
    fingerprint), computed once by the recipe's source (the HF forward, or capture engines), and what the draft kind
    needs of them stored; and over the ``validation`` split, which every checkpoint's held-out accuracy reads."""
    train_ds, fingerprint = train
    needs, options = _feature_plan(recipe, target, fingerprint)
    splits = {"train": train_ds, **({"validation": validation} if held_out_cached(recipe, target, validation)
                                    else {})}
    after = "; the shards written whole are kept: make room and rerun `drafttrain prepare` to write the others"
    with writing(run.features, "the offline feature cache", after=after), \
            cache_sources(recipe, target, needs, splits, cache_argmax=keeps_argmax(needs)) as sources:
        write_feature_cache(target, train_ds, needs, run.features, **options, progress=progress,
                            source=sources["train"])
        _write_held_out_cache(target, needs, run, options, (splits.get("validation"), sources.get("validation")),
                              progress)


def _write_held_out_cache(target: Target, needs, run: RunFolder, options: dict, held_out: tuple,
                          progress: bool) -> None:
    """The validation split's offline cache (``held_out``: its rows and their source; drafttrain's own layout,
    whatever the train split's), or none."""
    rows, source = held_out
    if source is None:
        run.remove(run.held_out_features, "a validation cache an earlier prepare wrote (this one has no validation)")
        return
    write_feature_cache(target, rows, needs, run.held_out_features, dtype=options["dtype"],
                        split_fingerprint=split_fingerprint(rows), rows_per_shard=options["rows_per_shard"],
                        progress=progress, source=source)


def held_out_cached(recipe: Recipe, target: Target, validation) -> bool:
    """Whether the validation split gets an offline cache: when there is one, and the kind's held-out measures read
    what a cache holds (sources/choose.py: caches_held_out)."""
    return validation is not None and len(validation) > 0 and caches_held_out(run_target_needs(recipe.draft, target))


def writes_features(recipe: Recipe) -> bool:
    """Whether prepare writes an offline cache of target outputs (the draft trains from it, not online)."""
    return recipe.training.hidden_states == "offline" and recipe.draft is not None


def _feature_plan(recipe: Recipe, target: Target, fingerprint: str):
    """What the offline cache stores for this recipe's kind, and how (the split's fingerprint, the dtype, the
    layout)."""
    needs, training = run_target_needs(recipe.draft, target), recipe.training
    return needs, {"split_fingerprint": fingerprint, "dtype": cache_dtype(training.feature_dtype, target),
                   "rows_per_shard": training.cache_shard_rows, "layout": training.written_layout,
                   "cache_from": training.cache_from}


def check_cache_layout(recipe: Recipe) -> None:
    """A cache that cannot be written in speculators' layout (a teacher's top-k), or a capture of speculators' that
    is not there, is refused before any work: the kind's needs from the target's shape alone (a target given with
    an adapter is merged as it loads, so its refusal comes when the cache starts, still before any row)."""
    training = recipe.training
    if not writes_features(recipe) or training.written_layout != "speculators":
        return
    if training.cache_from is not None:
        capture_files(training.cache_from)
    if recipe.target.adapter is None:
        refusal = layout_refusal(run_target_needs(recipe.draft, load_shape(recipe.target)))
        if refusal:
            raise DrafttrainError(refusal)


# --------------------------------------------------------------------------------------------------------------
# Building the summary


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items())) or "none"


def _rows_per_source(dataset, source_of: dict[str, str]) -> Counter:
    if dataset is None:
        return Counter()
    column = "conversation_ids" if "conversation_ids" in dataset.column_names else "conversation_id"
    counts: Counter = Counter()
    for value in dataset[column]:
        for cid in value if isinstance(value, list) else [value]:
            counts[source_of.get(cid, "?")] += 1
    return counts


def _source_summaries(recipe: Recipe, mixture, regen, tokenized: Counter,
                      source_of: dict[str, str]) -> dict[str, SourceSummary]:
    regenerated_per_source = Counter(source_of.get(str(c["id"]), "?") for c in regen.conversations) if regen else None
    regenerates = _regenerated_sources(recipe, mixture)
    return {
        name: SourceSummary(
            path=s["path"],
            records=s["records"],
            loaded=s["loaded"],
            taken=s.get("taken", 0),
            regenerated=regenerated_per_source.get(name, 0) if regen and regenerates[name] else None,
            tokenized_conversations=tokenized.get(name, 0),
        )
        for name, s in mixture.stats["sources"].items()
    }


def _skipped(mixture, regen, train_stats: dict, val_stats: dict) -> SkippedSummary:
    duplicates = mixture.stats.get("deduped", 0)
    tokenize_validation = dict(val_stats.get("skipped", {}))
    if val_stats.get("error"):
        tokenize_validation["whole split unusable"] = val_stats.get("conversations", 0)
    return SkippedSummary(
        load={f"{name}: {reason}": n for name, s in mixture.stats["sources"].items()
              for reason, n in s["skipped"].items()},
        dedupe={"duplicate conversation (in the source pool)": duplicates} if duplicates else {},
        regenerate=dict(regen.dropped) if regen else {},
        tokenize_train=dict(train_stats.get("skipped", {})),
        tokenize_validation=tokenize_validation,
    )


def _split_summary(dataset, stats: dict, path: Path) -> SplitSummary:
    return SplitSummary(
        path=str(path) if dataset is not None else None,
        rows=len(dataset) if dataset is not None else 0,
        conversations_in=stats.get("conversations", 0),
        conversations_tokenized=stats.get("tokenized", 0),
        tokens=int(stats.get("tokens", 0)),
        trainable_tokens=int(stats.get("trainable_tokens", 0)),
        cache_hit=stats.get("cache_hit"),
        feedback=stats.get("feedback"),
    )


def build_summary(
    recipe: Recipe,
    mixture,
    regen,
    train_set: tuple[Any, dict],
    validation_set: tuple[Any, dict],
    vocab_info: dict | None,
    run: RunFolder,
    seconds: dict[str, float],
) -> PrepareSummary:
    (train_ds, train_stats), (val_ds, val_stats) = train_set, validation_set
    source_of = {str(c["id"]): c["source"] for c in mixture.train + mixture.validation}
    tokenized = _rows_per_source(train_ds, source_of) + _rows_per_source(val_ds, source_of)
    return PrepareSummary(
        output_dir=str(run.root),
        target=target_name(recipe.target),
        seed=recipe.seed,
        sources=_source_summaries(recipe, mixture, regen, tokenized, source_of),
        mixture=MixtureSummary(
            train=mixture.stats["train"],
            validation=mixture.stats["validation"],
            prompt_only=mixture.stats.get("prompt_only", 0),
            duplicates_dropped=mixture.stats.get("deduped", 0),
        ),
        regenerate=regen.stats() if regen else None,
        datasets=DatasetsSummary(train=_split_summary(train_ds, train_stats, run.train_split),
                                 validation=_split_summary(val_ds, val_stats, run.validation_split)),
        skipped=_skipped(mixture, regen, train_stats, val_stats),
        replay=train_stats.get("replay"),
        draft_vocab=vocab_info,
        seconds={k: round(v, 2) for k, v in seconds.items()},
        recipe=redacted(recipe.model_dump(mode="json")),  # a key pasted into the recipe stays out of the file
    )


def print_summary(summary: PrepareSummary) -> None:
    """The summary as three tables: per source, totals, rows skipped."""
    console = Console()
    console.print(_sources_table(summary))
    console.print(_totals_table(summary))
    skipped = Table(title="rows skipped", title_justify="left")
    skipped.add_column("stage")
    skipped.add_column("reason")
    skipped.add_column("count", justify="right")
    for stage, reasons in dataclasses.asdict(summary.skipped).items():
        for reason, n in sorted(reasons.items()):
            skipped.add_row(stage, reason, str(n))
    if skipped.row_count:
        console.print(skipped)
    else:
        console.print("rows skipped: none")


def _sources_table(summary: PrepareSummary) -> Table:
    table = Table(title=f"drafttrain prepare: {summary.output_dir}", title_justify="left")
    for column in ("source", "records", "loaded", "taken", "regenerated", "tokenized"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for name, s in summary.sources.items():
        regenerated = "-" if s.regenerated is None else str(s.regenerated)
        cells = [s.records, s.loaded, s.taken, regenerated, s.tokenized_conversations]
        table.add_row(name, *map(str, cells))
    return table


def _totals_table(summary: PrepareSummary) -> Table:
    totals = Table(show_header=False, title="totals", title_justify="left")
    totals.add_column("what")
    totals.add_column("value", justify="right")
    for split in ("train", "validation"):
        d = getattr(summary.datasets, split)
        totals.add_row(f"{split} rows", str(d.rows))
        totals.add_row(f"{split} tokens (trainable)", f"{d.tokens:,} ({d.trainable_tokens:,})")
    regen = summary.regenerate
    if regen:
        totals.add_row("regenerated now / reused (this run, answer store)",
                       f"{regen['regenerated_now']} / {regen['reused_from_previous_run']}, {regen['reused_from_answer_store']}")
        totals.add_row("answers cut at max_new_tokens", str(regen["finish_reason"].get("length", 0)))
        speed = f"{regen['tokens_per_second']:.1f} tokens/s ({regen['generated_tokens']} tokens)"
        totals.add_row("generation speed", speed)
    for what, n in sorted((summary.datasets.train.feedback or {}).items()):
        totals.add_row(f"feedback: {what}", str(n))
    replay = summary.replay
    if replay:
        totals.add_row(f"replayed rows of {replay['run']}", f"{replay['rows']} of {replay['asked']} asked "
                                                           f"({replay['too_long']} too long)")
    vocab = summary.draft_vocab
    if vocab:
        coverage = f"{vocab['coverage']:.2%} train"
        if vocab.get("coverage_validation") is not None:
            coverage += f", {vocab['coverage_validation']:.2%} validation"
        totals.add_row(f"draft vocab {vocab['size']}/{vocab['target_vocab_size']} coverage", coverage)
        totals.add_row("distinct trainable tokens seen", f"{vocab['distinct_tokens_seen']:,}")
    totals.add_row("time", f"{sum(summary.seconds.values()):.1f} s")
    return totals


# --------------------------------------------------------------------------------------------------------------
# Entry points


def prepare(
    recipe: Recipe,
    target: Target | None = None,
    *,
    limit: int | None = None,
    progress: bool = True,
    show_summary: bool = True,
    features: bool = True,
) -> PrepareSummary:
    """Run the data pipeline of ``recipe`` (see the module docstring). ``target`` reuses an already loaded target.
    ``features=False`` leaves the offline cache to the caller (every process of a launch writes its shards)."""
    if recipe.data is None:
        raise DrafttrainError("the recipe has no data section: prepare needs data.sources")
    data = _with_limit(recipe.data, limit)
    run = RunFolder.of(recipe.output_dir)
    check_data_files(data)
    if target is None:  # a target that cannot load is named before any work (its config; its weights if present)
        checked_model_dir(recipe.target, weights_required=False)
    if recipe.draft is not None:
        check_vocabulary_choice(recipe.draft, recipe.draft_vocab.enabled)
    check_cache_layout(recipe)
    vocab_size = None
    if recipe.draft_vocab.enabled:
        vocab_size = target.vocab_size if target is not None else target_vocab_size_from_config(recipe)
        check_draft_vocab_size(recipe, vocab_size)
    # before any work: a folder drafttrain did not make (the home folder, the data's own), read-only or misplaced
    run.claim(reads=local_sources(data))
    with RunLock(run.root, "drafttrain prepare"):
        summary = _prepare_in(run, recipe, data, target, vocab_size, (progress, features))
    if show_summary:
        print_summary(summary)
    return summary


def _prepare_in(run: RunFolder, recipe: Recipe, data: DataConfig, target: Target | None, vocab_size: int | None,
                options: tuple[bool, bool]) -> PrepareSummary:
    """prepare's stages in its claimed and locked run folder; ``options``: (progress bars, the feature cache)."""
    progress, features = options
    seconds: dict[str, float] = {}
    with _timed(seconds, "load"):
        mixture = load_mixture(data, recipe.seed)
        log.info("%s", mixture.summary())
    if recipe.regenerate.enabled and recipe.regenerate.backend == "hf" and target is None:
        target = load_target(recipe.target)
    train, validation, regen = mixture.train, mixture.validation, None
    _warn_unanswered(recipe, mixture)
    if recipe.regenerate.enabled:
        with _timed(seconds, "regenerate"):
            train, validation, regen = _regenerate(recipe, mixture, target, run, progress)
    with _timed(seconds, "tokenize"):
        tokenizer = target.tokenizer if target is not None else load_tokenizer(recipe.target)
        tokenizer_id = tokenizer_fingerprint(tokenizer)
        with writing(run.data_cache(data.cache_dir), "the tokenised data", after=_AFTER_FAILED_WRITE):
            (train_ds, train_stats), (val_ds, val_stats) = _write_splits(recipe, data, (train, validation),
                                                                         (tokenizer, tokenizer_id), run)
    fingerprint = train_stats["fingerprint"]  # the split's content hash, computed once as it was tokenised
    vocab_info = None
    if recipe.draft_vocab.enabled:
        with _timed(seconds, "draft_vocab"):
            vocab_info = _build_vocab(recipe, (train_ds, fingerprint), val_ds, (tokenizer, tokenizer_id),
                                      vocab_size, run)
    else:
        run.remove(run.draft_vocab, "a draft vocabulary an earlier prepare built (it would not match this data)")
    if features and writes_features(recipe):
        with _timed(seconds, "features"):
            target = target if target is not None else process_target(recipe)
            _write_features(recipe, target, (train_ds, fingerprint), run, progress, validation=val_ds)

    summary = build_summary(
        recipe, mixture, regen, (train_ds, train_stats), (val_ds, val_stats), vocab_info, run, seconds
    )
    with writing(run.summary, "the prepare summary", after=_AFTER_FAILED_WRITE):
        write_text_atomic(run.summary, summary.to_json())
    return summary


@contextlib.contextmanager
def _timed(seconds: dict[str, float], stage: str):
    clock = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - clock


def prepare_launched(recipe: Recipe, state, limit: int | None, progress: bool) -> PrepareSummary | None:
    """``accelerate launch -m drafttrain prepare``: the data stages run on the main process; then every process
    loads the target on its device and writes its own shards of the offline cache; the main process joins them.
    A rerun after a crash writes only the shards without a record. Returns the summary on the main process."""
    if state.is_main_process and recipe.data is not None:
        RunFolder.of(recipe.output_dir).claim(reads=local_sources(recipe.data))
    with RunLock(recipe.output_dir, "drafttrain prepare"):  # rank 0 holds it for every rank
        return _prepare_launched(recipe, state, limit, progress)


def _prepare_launched(recipe: Recipe, state, limit: int | None, progress: bool) -> PrepareSummary | None:
    result = prepare(recipe, limit=limit, progress=progress, features=False) if state.is_main_process else None
    state.wait_for_everyone()
    if writes_features(recipe):
        run = RunFolder.of(recipe.output_dir)
        device = str(state.device) if recipe.target.device.startswith("cuda") else recipe.target.device
        target = process_target(recipe.model_copy(update={"target": recipe.target.model_copy(update={"device": device})}))
        train_ds = open_dataset(run.train_split)
        needs, options = _feature_plan(recipe, target, DataManifest.read(run).train)
        settings = cache_settings(target, train_ds, needs, **options)
        if state.is_main_process:
            start_cache(run.features, settings, train_ds)
        state.wait_for_everyone()
        validation = open_dataset(run.validation_split) if run.validation_split.is_dir() else None
        splits = {"train": train_ds, **({"validation": validation} if held_out_cached(recipe, target, validation)
                                        else {})}
        with cache_sources(recipe, target, needs, splits, rank=state.process_index, start=state.is_main_process,
                           cache_argmax=settings["argmax"]) as sources:
            written = write_shards(sources["train"], len(train_ds), run.features, settings, state.process_index,
                                   state.num_processes, progress, train=train_ds)
            log.info("rank %d wrote %d shards", state.process_index, written)
            state.wait_for_everyone()
            if state.is_main_process:
                join_shards(run.features, train_ds)
                _write_held_out_cache(target, needs, run, options, (splits.get("validation"), sources.get("validation")),
                                      progress)
            state.wait_for_everyone()  # the main process's servers stay up until every process is done
    return result
