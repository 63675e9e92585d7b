"""Tokenise conversations with the target's own chat template and mark exactly the assistant tokens as trainable.

How the mask is found (no per-model separators anywhere):
  1. Render the whole conversation as text with ``tokenizer.apply_chat_template(..., tokenize=False)``.
  2. For each assistant message i, render ``messages[:i]`` with the generation prompt (ends with the assistant header,
     e.g. ``<|im_start|>assistant\\n``) and ``messages[:i+1]`` without it. Both must be prefixes of the full text
     (the template is prefix-stable); what lies between them is what the model produces for that turn: its content as
     the template renders it (trimmed by Llama-3, tool calls in the model's own syntax, Qwen3's empty think block ...)
     followed by the end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``). Trailing whitespace (the ``\\n`` a ChatML
     template writes after ``<|im_end|>``) is separator, not output, and stays untrained.
  3. Tokenise the full text once with ``return_offsets_mapping=True``; a token is trainable when its character span
     overlaps an assistant span. Injected text (default system prompts, Llama-3's date header) simply lies outside
     every span.
Templates whose history rendering differs from the last turn's (reasoning templates that drop old ``<think>``
blocks) fall back to locating the message content inside the full text.

Tool calls, tool results and system turns are adapted to what the template can render by
:mod:`drafttrain.data.chat`, the same way for regeneration and evaluation.

Evaluation feedback (the closed loop, drafttrain.data.traffic): a conversation whose last answer carries the token
ids the target emitted is trained on those ids (the re-tokenised answer must spell the same text: a target may
emit a tokenisation its tokenizer would not produce), and the positions where the target replaced refused draft
tokens get the source's ``rejected_weight``: ``loss_mask`` is then a small integer loss weight (0 = not trained),
which every kind's loss takes as the weight of predicting that token. An answer whose text differs trains
unweighted as re-tokenised (counted); an answer cut at the evaluation's token limit does not train its end-of-turn.

Dataset columns (``build_tokenized_dataset``): ``input_ids``, ``loss_mask``, ``num_tokens``, ``num_trainable`` and
``conversation_id`` (str); packed rows instead carry ``conversation_ids`` (list[str]) and ``position_ids`` restarting
at 0 for each document.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import random
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import datasets
import numpy as np
from datasets import Dataset, Features, Value
from datasets import Sequence as Seq

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig
from drafttrain.data.chat import (
    TemplateRejected,
    adapt_to_template,
    chat_template_text,
    render_text,
    template_support,
)
from drafttrain.data.traffic import ANSWER_WEIGHTS
from drafttrain.progress import progress_bar
from drafttrain.runfolder import DataManifest, RunFolder, cache_root, damaged, file_sha256, open_dataset, read_json
from drafttrain.userfiles import remove

log = logging.getLogger(__name__)

# Bump when the tokenised output of the same inputs changes (new columns, mask rules ...): old caches are ignored.
FORMAT_VERSION = 2
_CACHE_MARKER = "drafttrain_stats.json"


class SkipConversation(Exception):
    """The conversation yields no training row; the message is the counted reason."""


def _render(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    try:
        return render_text(tokenizer, messages, tools, add_generation_prompt)
    except TemplateRejected as why:
        raise SkipConversation(str(why)) from None


# ----------------------------------------------------------------------------------------------- spans and masks


def _rendered_content(msg: dict) -> str:
    return msg["content"].strip()


def _locate_by_content(full: str, start: int, upto: str, msg: dict) -> int:
    """End of the turn when ``messages[:i+1]`` is not a prefix of the full text: find the content, add the end marker."""
    content = _rendered_content(msg)
    at = full.find(content, start) if content else start
    tail_at = upto.rfind(content) if content else -1
    if at < 0 or tail_at < 0:
        raise SkipConversation("chat template is not prefix-stable (assistant turn not found in the full render)")
    tail = upto[tail_at + len(content):].rstrip()
    end = at + len(content)
    if not full.startswith(tail, end):
        raise SkipConversation("chat template is not prefix-stable (end-of-turn differs in the full render)")
    return end + len(tail)


def assistant_spans(tokenizer, conversation: dict) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character span of each assistant output (content + end-of-turn)."""
    chat_template_text(tokenizer)
    if conversation.get("needs_response"):
        raise SkipConversation("prompt-only (needs_response): no assistant turn to train on")
    messages, tools = adapt_to_template(conversation, template_support(tokenizer))
    while messages and messages[-1]["role"] != "assistant":  # trailing prompts carry no loss
        messages.pop()
    if not messages:
        raise SkipConversation("no assistant turn")
    full = _render(tokenizer, messages, tools, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            raise SkipConversation("conversation starts with an assistant turn")
        head = _render(tokenizer, messages[:i], tools, True)
        if not full.startswith(head):
            # The generation prompt differs from how history is rendered: start after the previous message.
            head = _render(tokenizer, messages[:i], tools, False)
            if not full.startswith(head):
                raise SkipConversation("chat template is not prefix-stable (history renders differently)")
            content = _rendered_content(msg)
            at = full.find(content, len(head)) if content else -1
            head = full[:at] if at >= 0 else head
        start = len(head)
        upto = _render(tokenizer, messages[: i + 1], tools, False)
        if full.startswith(upto) and len(upto) >= start:
            end = start + len(full[start: len(upto)].rstrip())
        else:
            end = _locate_by_content(full, start, upto, msg)
        if end > start:
            spans.append((start, end))
    return full, spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and end > start and start < spans[k][1] and end > spans[k][0]
        mask.append(1 if inside else 0)
    return mask


def _encode_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), _mask_from_offsets(enc["offset_mapping"], spans)
    # Slow tokenizers have no offsets: encode the pieces separately (boundaries sit at special tokens in practice).
    ids: list[int] = []
    mask: list[int] = []
    cuts = sorted({0, len(text), *(p for span in spans for p in span)})
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        trainable = any(s <= a and b <= e for s, e in spans)
        ids += piece
        mask += [int(trainable)] * len(piece)
    return ids, mask


def _last_answer(mask: list[int]) -> tuple[int, int]:
    """[start, end) of the last run of trainable tokens: the last assistant turn (a user turn's header always lies
    between two turns)."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return start, end


def _logged_length(tokenizer, ids: list[int], start: int, end: int, logged: list[int]) -> int | None:
    """How many re-tokenised tokens from ``start`` spell the logged ids' text (the target may have emitted a
    tokenisation the tokenizer would not produce: "\n\n" as two tokens); None when no prefix of the turn does."""
    if ids[start: start + len(logged)] == logged:
        return len(logged)
    text = tokenizer.decode(logged)
    for m in range(1, end - start + 1):
        piece = tokenizer.decode(ids[start: start + m])
        if piece == text:
            return m
        if len(piece) > len(text):
            break
    return None


def _weighted(tokenizer, ids: list[int], mask: list[int], feedback: dict, notes: Counter) -> tuple[list, list]:
    """The row with the last answer as the logged token ids (what the target computed), its refused-draft
    positions weighted (see the module docstring)."""
    start, end = _last_answer(mask)
    logged = feedback["answer_ids"]
    m = _logged_length(tokenizer, ids, start, end, logged)
    if m is None:
        if not feedback["complete"]:
            raise SkipConversation("answer cut at the evaluation's token limit whose text differs from the logged "
                                   "token ids' (its end cannot be found)")
        notes["answers whose text differs from the logged ids' (trained unweighted)"] += 1
        return ids, mask
    if m != len(logged):
        notes["answers the target tokenised otherwise (its ids kept)"] += 1
    weights = [1] * len(logged)
    for i in feedback["rejected_at"]:
        weights[i] = feedback["rejected_weight"]
    # the template's end-of-turn after a cut answer is not the target's output
    tail = mask[start + m:] if feedback["complete"] else [0] * (end - start - m) + mask[end:]
    notes["answers weighted"] += 1
    notes["rejected positions weighted"] += len(feedback["rejected_at"])
    return ids[:start] + logged + ids[start + m:], mask[:start] + weights + tail


def _tokenize(tokenizer, conversation: dict, max_length: int, overlength: str, notes: Counter) -> dict:
    text, spans = assistant_spans(tokenizer, conversation)
    ids, mask = _encode_with_mask(tokenizer, text, spans)
    if not any(mask):
        raise SkipConversation("no trainable tokens")
    if conversation.get(ANSWER_WEIGHTS):
        ids, mask = _weighted(tokenizer, ids, mask, conversation[ANSWER_WEIGHTS], notes)
    if len(ids) > max_length:
        if overlength == "drop":
            raise SkipConversation("longer than max_length (overlength=drop)")
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise SkipConversation("no trainable tokens after truncation")
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_conversation(
    tokenizer,
    conversation: dict,
    max_length: int,
    overlength: str = "truncate",
    skipped: Counter | None = None,
    weighted: Counter | None = None,
) -> dict | None:
    """``{"input_ids", "loss_mask"}`` for one conversation, or None when it is skipped (reason counted in ``skipped``).
    ``weighted`` counts what evaluation feedback weighted (and the answers it could not).

    ``overlength="truncate"`` keeps the first ``max_length`` tokens; ``"drop"`` skips longer conversations.
    A tokenizer without a chat template is a DrafttrainError, not a skip.
    """
    if overlength not in ("truncate", "drop"):
        raise ValueError(f"overlength must be 'truncate' or 'drop', not {overlength!r}")
    try:
        return _tokenize(tokenizer, conversation, max_length, overlength, Counter() if weighted is None else weighted)
    except SkipConversation as why:
        if skipped is not None:
            skipped[str(why)] += 1
        log.debug("skipped conversation %s: %s", conversation.get("id"), why)
        return None


# ----------------------------------------------------------------------------------------------- packing and batching


def pack_plan(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group row indices into bins of total length <= max_length (best-fit decreasing: few, full bins).

    Deterministic: ties are broken by row index; documents inside a bin keep ascending index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for i in order:
        n = lengths[i]
        if n > max_length:
            raise ValueError(f"row {i} has {n} tokens, more than max_length={max_length}; truncate or drop it first")
        at = bisect.bisect_left(free, (n, -1))  # the tightest bin it fits in
        if at < len(free):
            space, b = free.pop(at)
        else:
            space, b = max_length, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, b))
    return [sorted(b) for b in bins]


def _packed_row(rows: Sequence[dict]) -> dict:
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "position_ids": [], "conversation_ids": []}
    for row in rows:
        out["input_ids"] += row["input_ids"]
        out["loss_mask"] += row["loss_mask"]
        out["position_ids"] += list(range(len(row["input_ids"])))  # restart per document (varlen attention)
        if "conversation_id" in row:
            out["conversation_ids"].append(row["conversation_id"])
    return dict(out, num_tokens=len(out["input_ids"]), num_trainable=trainable_count(out["loss_mask"]))


def pack(rows: Sequence[dict], max_length: int) -> list[dict]:
    """Concatenate tokenised rows into rows of at most max_length tokens, with per-document ``position_ids``."""
    return [_packed_row([rows[i] for i in b]) for b in pack_plan([len(r["input_ids"]) for r in rows], max_length)]


def length_grouped_order(lengths: Sequence[int], batch_size: int, seed: int, groups_of: int = 64) -> list[int]:
    """A permutation of row indices where consecutive batches hold rows of similar length (less padding).

    Rows are shuffled, cut into groups of ``batch_size * groups_of``, sorted by length inside each group and cut into
    batches; the batches are then shuffled, so batch lengths vary from step to step while each batch is homogeneous.
    A batch short of ``batch_size`` (the rows left over) goes last, so that every batch starts at a multiple of
    ``batch_size`` and a sampler cutting the order there cuts it at the batches.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    size = batch_size * groups_of
    batches = []
    for start in range(0, len(order), size):
        group = sorted(order[start: start + size], key=lambda i: (-lengths[i], i))
        batches += [group[j: j + batch_size] for j in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    batches.sort(key=lambda batch: len(batch) < batch_size)  # stable: only a short batch moves, to the end
    return [i for batch in batches for i in batch]


# ----------------------------------------------------------------------------------------------- cached dataset


def tokenizer_fingerprint(tokenizer) -> str:
    """Content hash of a tokenizer: vocabulary/merges/normalisation (backend JSON), size and special tokens (16 hex).

    The one identity of a tokenizer that every artifact records. The path it was loaded from is left out on
    purpose: a copied model folder reuses its caches.
    """
    h = hashlib.sha256()
    h.update(f"{type(tokenizer).__name__}\0{len(tokenizer)}\0".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    specials = {k: str(v) for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    h.update(json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()[:16]


def trainable_count(loss_mask: Sequence[int]) -> int:
    """Trained positions (a loss weight above 0), not the sum of their weights."""
    return sum(1 for w in loss_mask if w)


def iter_token_rows(dataset, batch_size: int = 1024):
    """(input_ids int64, loss_mask int8) numpy arrays per row of a tokenised split (or any iterable of such dicts);
    the mask holds loss weights, 0 = not trained."""
    if hasattr(dataset, "iter"):
        rows = (row for batch in dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=batch_size)
                for row in zip(batch["input_ids"], batch["loss_mask"]))
    else:
        rows = ((row["input_ids"], row["loss_mask"]) for row in dataset)
    for ids, mask in rows:
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int8)
        if ids.shape != mask.shape:
            raise DrafttrainError(f"input_ids and loss_mask differ in length ({ids.shape[0]} vs {mask.shape[0]})")
        yield ids, mask


def split_fingerprint(dataset) -> str:
    """Content hash of a tokenised split (every row's tokens and loss mask, in order; 16 hex): what artifacts
    derived from the split (draft vocab, feature cache, checkpoints) record and are checked against."""
    digest = hashlib.sha256()
    for ids, mask in iter_token_rows(dataset):
        digest.update(np.int64(ids.shape[0]).tobytes())
        digest.update(ids.tobytes())
        digest.update(np.packbits(mask > 0).tobytes())
        if mask.max(initial=0) > 1:  # weights from evaluation feedback (a 0/1 split keeps its earlier fingerprint)
            digest.update(mask.tobytes())
    return digest.hexdigest()[:16]


def describe_run_data(run: RunFolder, train_fingerprint: str, validation, tokenizer_fingerprint: str | None,
                      target: str) -> DataManifest:
    """The run folder's data as its manifest records it: the train split's fingerprint (computed once, by whoever
    made or opened the split), the validation split's and the held-out prompts' (read here), the tokenizer's
    fingerprint and the target's name."""
    return DataManifest(train=train_fingerprint,
                        validation=split_fingerprint(validation) if validation is not None else None,
                        validation_prompts=(file_sha256(run.validation_prompts)
                                            if run.validation_prompts.is_file() else None),
                        tokenizer=tokenizer_fingerprint, target=target)


def conversations_fingerprint(conversations: Iterable[dict]) -> str:
    h = hashlib.sha256()
    for conv in conversations:
        h.update(json.dumps(conv, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def cache_key(conversations: Sequence[dict], tokenizer, data_cfg: DataConfig) -> str:
    """Hash of everything that shapes the tokenised dataset."""
    parts = {
        "format_version": FORMAT_VERSION,
        "conversations": conversations_fingerprint(conversations),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": hashlib.sha256(chat_template_text(tokenizer).encode()).hexdigest(),
        "max_length": data_cfg.max_length,
        "overlength": data_cfg.overlength,
        "packing": data_cfg.packing,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _features(packed: bool):
    cols = {"input_ids": Seq(Value("int32")), "loss_mask": Seq(Value("int8"))}
    if packed:
        cols.update(position_ids=Seq(Value("int32")), conversation_ids=Seq(Value("string")))
    else:
        cols["conversation_id"] = Value("string")
    cols.update(num_tokens=Value("int32"), num_trainable=Value("int32"))
    return Features(cols)


def _row_generator(conversations: Sequence[dict], tokenizer, data_cfg: DataConfig, stats: dict):
    def generate():
        skipped, weighted = Counter(), Counter()
        bar = progress_bar(conversations, desc="tokenising", unit="conv", enabled=len(conversations) >= 1000)
        for conv in bar:
            row = tokenize_conversation(tokenizer, conv, data_cfg.max_length, data_cfg.overlength, skipped, weighted)
            if row is None:
                continue
            trainable = trainable_count(row["loss_mask"])
            stats["tokens"] += len(row["input_ids"])
            stats["trainable_tokens"] += trainable
            stats["tokenized"] += 1
            yield dict(row, conversation_id=str(conv.get("id", "")), num_tokens=len(row["input_ids"]),
                       num_trainable=trainable)
        stats["skipped"] = dict(skipped)
        if weighted:
            stats["feedback"] = dict(weighted)

    return generate


def _packed_generator(rows, max_length: int, stats: dict):
    def generate():
        plan = pack_plan(rows["num_tokens"], max_length)
        stats["rows"] = len(plan)
        for b in plan:
            yield _packed_row([rows[i] for i in b])

    return generate


@contextlib.contextmanager
def _quiet_datasets_bars():
    """Our own tqdm bar counts conversations; datasets' per-split bars would only repeat it."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _build(conversations: Sequence[dict], tokenizer, data_cfg: DataConfig, key: str, work: Path, stats: dict):
    with _quiet_datasets_bars():
        return _build_rows(conversations, tokenizer, data_cfg, key, work, stats)


def _build_rows(conversations: Sequence[dict], tokenizer, data_cfg: DataConfig, key: str, work: Path, stats: dict):
    # from_generator streams rows to Arrow (no whole-dataset Python lists); the explicit fingerprint keeps datasets
    # from hashing the closure, and its builder cache lives in our own work folder.
    try:
        rows = Dataset.from_generator(_row_generator(conversations, tokenizer, data_cfg, stats),
                                      features=_features(False), cache_dir=str(work / "rows"),
                                      fingerprint=f"{key}-rows")
    except ValueError:
        if stats["tokenized"]:
            raise
        rows = None  # datasets refuses to build an empty split
    if rows is None or len(rows) == 0:
        reasons = ", ".join(f"{r}: {n}" for r, n in Counter(stats["skipped"]).most_common(5)) or "no conversations"
        raise DrafttrainError(f"no conversation could be tokenised ({reasons})")
    stats["rows"] = len(rows)
    if not data_cfg.packing:
        return rows
    return Dataset.from_generator(_packed_generator(rows, data_cfg.max_length, stats), features=_features(True),
                                  cache_dir=str(work / "packed"), fingerprint=f"{key}-packed")


def _default_cache_dir() -> Path:
    return cache_root() / "data"


def build_tokenized_dataset(
    conversations: Sequence[dict],
    tokenizer,
    data_cfg: DataConfig,
    cache_dir: str | Path | None = None,
):
    """Tokenise conversations into an Arrow dataset, cached on disk under a key of everything that shapes it.

    Returns ``(datasets.Dataset, stats)``; ``stats["cache_hit"]`` says whether it was reused. The cache folder is
    ``cache_dir`` (else ``data_cfg.cache_dir``, else ``~/.cache/drafttrain/data``) / ``tokenized/<key>``, written
    atomically (temp folder + rename), so an interrupted build never leaves a half dataset behind. A cached dataset
    is used only when its content still hashes to the fingerprint recorded beside it; a damaged one is rebuilt.
    """
    root = Path(cache_dir or data_cfg.cache_dir or _default_cache_dir()).expanduser() / "tokenized"
    key = cache_key(conversations, tokenizer, data_cfg)
    final = root / key
    if (final / _CACHE_MARKER).is_file():
        cached = _verified_cache(final)
        if cached is not None:
            return cached

    stats: dict = {"conversations": len(conversations), "tokenized": 0, "rows": 0, "tokens": 0,
                   "trainable_tokens": 0, "skipped": {}, "packed": data_cfg.packing,
                   "max_length": data_cfg.max_length, "overlength": data_cfg.overlength, "cache_key": key}
    root.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work, tmp = root / f".{key}.work-{tag}", root / f".{key}.tmp-{tag}"
    try:
        dataset = _build(conversations, tokenizer, data_cfg, key, work, stats)
        stats["fingerprint"] = split_fingerprint(dataset)
        with _quiet_datasets_bars():
            dataset.save_to_disk(str(tmp))
        (tmp / _CACHE_MARKER).write_text(json.dumps(stats, indent=1, sort_keys=True))
        try:
            os.replace(tmp, final)
        except OSError:  # another process published the same key first: theirs is identical
            if not (final / _CACHE_MARKER).is_file():
                raise
    finally:
        remove(work, "the scratch of this tokenisation")
        remove(tmp, "this tokenisation's unpublished copy")
    log.info("tokenised data: %d rows (%d conversations, %d skipped) -> %s", stats["rows"], stats["tokenized"],
             sum(stats["skipped"].values()), final)
    stats.update(cache_hit=False, cache_path=str(final))
    return open_dataset(final), stats


def _is_cache_entry(folder: Path) -> bool:
    """A tokenised-data cache entry drafttrain wrote: it carries the record written with it."""
    return (folder / _CACHE_MARKER).is_file()


def _verified_cache(folder: Path):
    """(dataset, stats) of a cached tokenisation whose content matches its recorded fingerprint, else None (the
    folder is removed, with a warning, and rebuilt by the caller)."""
    try:
        stats = read_json(folder / _CACHE_MARKER)
        dataset = open_dataset(folder)
        if split_fingerprint(dataset) != stats.get("fingerprint"):
            raise damaged(folder, "does not hash to the fingerprint recorded when it was built")
    except DrafttrainError as why:
        log.warning("tokenised data cache %s is unusable, rebuilding it: %s", folder, why)
        remove(folder, "a damaged tokenised-data cache entry", inside=folder, made=_is_cache_entry)
        return None
    stats.update(cache_hit=True, cache_path=str(folder))
    log.info("tokenised data: cache hit %s", folder)
    return dataset, stats


def format_tokenize_stats(stats: dict) -> str:
    skipped = ", ".join(f"{r}: {n}" for r, n in sorted(stats["skipped"].items())) or "none"
    return (f"tokenised {stats['tokenized']}/{stats['conversations']} conversations into {stats['rows']} rows "
            f"({stats['tokens']} tokens, {stats['trainable_tokens']} trainable; packed={stats['packed']}, "
            f"max_length={stats['max_length']}, overlength={stats['overlength']}); skipped: {skipped}"
            f"{_feedback_note(stats)}{' [cache hit]' if stats.get('cache_hit') else ''}")


def _feedback_note(stats: dict) -> str:
    counts = stats.get("feedback")
    return "; evaluation feedback: " + ", ".join(f"{r}: {n}" for r, n in sorted(counts.items())) if counts else ""
