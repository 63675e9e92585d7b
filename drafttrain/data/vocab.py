"""Draft vocabulary for EAGLE-3: the N target tokens the draft head predicts over.

EAGLE-3 drafts over a reduced vocabulary (e.g. 32k of Llama-3's 128k) to shrink the draft lm_head. The N ids are
the most frequent *trainable* target tokens (loss-masked, i.e. the tokens the draft learns to predict) of the
training split. The mapping is stored as in EAGLE-3 / SpecForge so that checkpoints interoperate:

  * ``d2t``: int64 [N], draft id -> offset, ``target_id = draft_id + d2t[draft_id]``; draft ids follow the
    target ids in ascending order;
  * ``t2d``: bool [V], True where a target id is in the draft vocabulary.

Ties in frequency go to the lower target id. If N exceeds the number of distinct tokens seen, the rest is filled
with unseen ids in ascending id order (tokenizer order: in BPE vocabularies the low ids are the special tokens,
bytes and earliest merges, the most generic tokens), so the draft vocabulary always has exactly N entries.

The file's metadata keys it to the data and the tokenizer (content hashes): a mapping built for other data or
another tokenizer is detected on load instead of silently mis-indexing the draft's logits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.data.tokenize import iter_token_rows, split_fingerprint, tokenizer_fingerprint
from drafttrain.runfolder import damaged, read_safetensors

log = logging.getLogger(__name__)

FORMAT = "drafttrain-draft-vocab"
FORMAT_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class DraftVocabKey:
    """What a draft vocab was built from: content hashes of the tokenised data and of the tokenizer."""

    data: str
    tokenizer: str


@dataclasses.dataclass
class TokenCounts:
    counts: torch.Tensor  # int64 [V]: occurrences of each target id among trainable tokens
    dataset: Any = dataclasses.field(repr=False)
    known_hash: str | None = None  # the split's fingerprint when the caller has it already

    @functools.cached_property
    def data_hash(self) -> str:
        """The split's fingerprint (over every row's input_ids and loss_mask), computed only when asked for."""
        return self.known_hash or split_fingerprint(self.dataset)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def distinct(self) -> int:
        return int((self.counts > 0).sum())


@dataclasses.dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [N]
    t2d: torch.Tensor  # bool [V]
    key: DraftVocabKey
    coverage: float  # share of the training data's trainable tokens that are in the draft vocab
    trainable_tokens: int
    distinct_tokens_seen: int

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    def target_ids(self) -> torch.Tensor:
        """Target id of each draft id, ascending."""
        return torch.arange(self.size, dtype=torch.long) + self.d2t

    def summary(self) -> dict:
        return {
            "size": self.size,
            "target_vocab_size": self.target_vocab_size,
            "coverage": round(self.coverage, 6),
            "trainable_tokens": self.trainable_tokens,
            "distinct_tokens_seen": self.distinct_tokens_seen,
            "data_hash": self.key.data,
            "tokenizer_hash": self.key.tokenizer,
        }


# --------------------------------------------------------------------------------------------------------------
# Keys


def count_trainable_tokens(dataset, vocab_size: int, data_hash: str | None = None) -> TokenCounts:
    """Counts of target ids over the trainable (loss_mask > 0) positions, and the split's fingerprint
    (``data_hash`` when the caller has it)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in iter_token_rows(dataset):
        trainable = ids[mask > 0]
        if trainable.size and (trainable.max() >= vocab_size or trainable.min() < 0):
            raise DrafttrainError(
                f"token id {int(trainable.max())} in the data is outside the target vocabulary of {vocab_size}: "
                "the data was tokenised with another tokenizer"
            )
        counts += np.bincount(trainable, minlength=vocab_size)
    return TokenCounts(torch.from_numpy(counts), dataset, data_hash)


# --------------------------------------------------------------------------------------------------------------
# Selection


def select_draft_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids, returned in ascending id order (ties and fill: lower id first)."""
    vocab_size = int(counts.shape[0])
    if size > vocab_size:
        raise DrafttrainError(
            f"draft_vocab.size {size} is larger than the target vocabulary ({vocab_size} tokens); "
            f"use at most {vocab_size}"
        )
    # A stable sort on -count keeps ascending ids within equal counts, zero counts included (the fill rule).
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return torch.sort(order[:size]).values


def build_mapping(selected: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for ascending target ids ``selected``."""
    d2t = selected.to(torch.int64) - torch.arange(selected.shape[0], dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def coverage_of(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted tokens that are in the draft vocab (1.0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 1.0


def size_for_coverage(counts: torch.Tensor, coverage: float, multiple: int = 64) -> int:
    """The fewest most-frequent ids that cover ``coverage`` of the counted tokens, rounded up to ``multiple``."""
    cumulative = torch.sort(counts.to(torch.float64), descending=True).values.cumsum(0) / counts.sum()
    needed = int(torch.searchsorted(cumulative, torch.tensor([coverage], dtype=torch.float64) - 1e-12)[0]) + 1
    return min(counts.numel(), -(-needed // multiple) * multiple)


def build_draft_vocab(dataset, tokenizer, vocab_size: int, size: int, coverage: float | None = None,
                      key: DraftVocabKey | None = None, keep: torch.Tensor | None = None) -> DraftVocab:
    """Count the trainable tokens of ``dataset`` and keep the ``size`` most frequent as the draft vocabulary (with
    ``coverage``: as few as reach that share of the tokens, at most ``size``). ``key``: the split's and the
    tokenizer's fingerprints when the caller has them (else computed here). ``keep``: target ids that stay (a
    continued draft's own vocabulary): the vocabulary is those and every trainable token of the data they lack,
    whatever ``size`` and ``coverage`` say."""
    if size > vocab_size:
        select_draft_ids(torch.zeros(vocab_size, dtype=torch.int64), size)  # raises with both sizes
    counts = count_trainable_tokens(dataset, vocab_size, key.data if key is not None else None)
    if counts.total == 0:
        raise DrafttrainError("the data has no trainable tokens (loss_mask is all zero): cannot build a draft vocab")
    if keep is not None:
        return _vocab(_extended(keep, counts), counts, tokenizer, key)
    if coverage is not None:
        size = min(size, size_for_coverage(counts.counts, coverage))
        log.info("draft vocab: %d tokens cover %.1f%% of the trainable tokens", size, 100 * coverage)
    if counts.distinct < size and coverage is None:  # with coverage, the ids past the data are its rounding to 64
        log.warning(
            "draft vocab: only %d distinct trainable tokens in the data for a size of %d; the other %d ids are "
            "filled in id order (more data, or a smaller draft_vocab.size, gives a better-founded vocabulary)",
            counts.distinct, size, size - counts.distinct,
        )
    return _vocab(select_draft_ids(counts.counts, size), counts, tokenizer, key)


def _extended(keep: torch.Tensor, counts: TokenCounts) -> torch.Tensor:
    """The ids ``keep`` and the counted ones they lack, ascending."""
    kept = torch.zeros_like(counts.counts, dtype=torch.bool)
    kept[keep] = True
    added = int(((counts.counts > 0) & ~kept).sum())
    log.info("draft vocab: the continued draft's %d tokens and %d more the data trains on (%.1f%% of its tokens)",
             keep.numel(), added, 100 * float(counts.counts[~kept].sum()) / counts.total)
    return torch.nonzero(kept | (counts.counts > 0)).flatten()


def _vocab(selected: torch.Tensor, counts: TokenCounts, tokenizer, key: DraftVocabKey | None) -> DraftVocab:
    d2t, t2d = build_mapping(selected, counts.counts.numel())
    return DraftVocab(
        d2t=d2t,
        t2d=t2d,
        key=key or DraftVocabKey(data=counts.data_hash, tokenizer=tokenizer_fingerprint(tokenizer)),
        coverage=coverage_of(counts.counts, t2d),
        trainable_tokens=counts.total,
        distinct_tokens_seen=counts.distinct,
    )


def dataset_coverage(dataset, vocab: DraftVocab) -> float:
    """Coverage of the draft vocab on another split (e.g. validation: an out-of-sample figure)."""
    return coverage_of(count_trainable_tokens(dataset, vocab.target_vocab_size).counts, vocab.t2d)


# --------------------------------------------------------------------------------------------------------------
# Files


def save_draft_vocab(vocab: DraftVocab, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "data_hash": vocab.key.data,
        "tokenizer_hash": vocab.key.tokenizer,
        "draft_vocab_size": str(vocab.size),
        "target_vocab_size": str(vocab.target_vocab_size),
        "coverage": repr(vocab.coverage),
        "trainable_tokens": str(vocab.trainable_tokens),
        "distinct_tokens_seen": str(vocab.distinct_tokens_seen),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600; the mapping is shared like the datasets beside it
    tmp.replace(path)
    return path


def load_draft_vocab(path: str | Path, expect_key: DraftVocabKey | None = None) -> DraftVocab:
    """Load and check a draft vocab; with ``expect_key``, a mapping built from other data/tokenizer raises."""
    path = Path(path)
    if not path.is_file():
        raise DrafttrainError(f"draft vocab not found: {path} (run `drafttrain prepare` with draft_vocab.enabled)")
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise damaged(path, f"is not a drafttrain draft vocab (metadata format {metadata.get('format')!r})")
    try:
        vocab = DraftVocab(
            d2t=tensors["d2t"],
            t2d=tensors["t2d"],
            key=DraftVocabKey(data=metadata["data_hash"], tokenizer=metadata["tokenizer_hash"]),
            coverage=float(metadata["coverage"]),
            trainable_tokens=int(metadata["trainable_tokens"]),
            distinct_tokens_seen=int(metadata["distinct_tokens_seen"]),
        )
    except (KeyError, ValueError) as err:
        raise damaged(path, f"lacks or garbles its {err} entry") from None
    _check_consistent(vocab, path)
    if expect_key is not None:
        _check_key(vocab.key, expect_key, path)
    return vocab


def _check_consistent(vocab: DraftVocab, path: Path) -> None:
    _check_mapping(vocab.d2t, vocab.t2d, path)


def mapping_problem(d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int | None = None) -> str | None:
    """What is wrong with a draft vocabulary's maps, or None: the values are checked, not only the shapes. Every
    draft id must name a target id inside the target's vocabulary, no two the same (ascending, as every writer
    orders them), and t2d must be exactly the set d2t names (its inverse), over the target's whole vocabulary."""
    d2t, t2d = d2t.detach().cpu(), t2d.detach().cpu()
    if d2t.dtype not in (torch.int64, torch.int32) or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        return f"d2t must be integers and t2d booleans, one dimension each (got {d2t.dtype}, {t2d.dtype})"
    if target_vocab_size is not None and t2d.numel() != target_vocab_size:
        return f"t2d covers {t2d.numel()} target ids, the target has {target_vocab_size}"
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.long()
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel()):
        return (f"d2t maps draft ids to target ids {int(target_ids.min())}..{int(target_ids.max())}, outside the "
                f"target's vocabulary of {t2d.numel()}")
    if not bool((target_ids[1:] > target_ids[:-1]).all()):
        return "d2t maps two draft ids to the same target id (or out of order)"
    if not torch.equal(torch.nonzero(t2d).flatten(), target_ids):
        return "t2d is not the inverse of d2t: it marks other target ids than d2t names"
    return None


def _check_mapping(d2t: torch.Tensor, t2d: torch.Tensor, path: Path, target_vocab_size: int | None = None) -> None:
    problem = mapping_problem(d2t, t2d, target_vocab_size)
    if problem is not None:
        raise damaged(path, f"holds d2t and t2d that do not describe one draft vocabulary: {problem}")


def read_vocab_mapping(path: str | Path, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from any safetensors file that holds them (ours, or another EAGLE-3 trainer's), checked against
    the target's vocabulary size and for consistency."""
    path = Path(path)
    if not path.is_file():
        raise DrafttrainError(f"draft vocab file not found: {path} (run `drafttrain prepare` first)")
    tensors, _ = read_safetensors(path)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DrafttrainError(f"draft vocab {path} lacks d2t/t2d tensors")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if t2d.numel() != target_vocab_size:
        raise DrafttrainError(f"draft vocab {path} was built for a vocabulary of {t2d.numel()} tokens, the target "
                              f"has {target_vocab_size}")
    if d2t.numel() > target_vocab_size:
        raise DrafttrainError(f"draft vocab size {d2t.numel()} is larger than the target's {target_vocab_size}")
    _check_mapping(d2t, t2d, path)
    return d2t, t2d


def draft_vocab_for(configured: str | Path | None, run, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft: the recipe's ``draft_vocab`` file, else the run's (``run``: a RunFolder, prepare wrote
    it), else the full vocabulary (draft id == target id)."""
    path = configured or (run.draft_vocab if run is not None and run.draft_vocab.is_file() else None)
    if path is not None:
        return read_vocab_mapping(path, vocab_size)
    return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of each draft id (d2t holds the offsets)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids ``ids`` (-1 for those outside the draft vocabulary)."""
    t2d = t2d.to(ids.device)
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[ids], index[ids], torch.full_like(ids, -1))


def to_target_vocab(draft_logits: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits scattered into the target vocabulary, -inf elsewhere, so proposers speak target ids."""
    if d2t.numel() == t2d.numel():
        return draft_logits
    return scatter_to_vocab(draft_logits, draft_ids(d2t), t2d.numel())


def scatter_to_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over target ids ``ids`` placed at those ids of a ``vocab_size`` vocabulary, -inf elsewhere."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


def _check_key(found: DraftVocabKey, expected: DraftVocabKey, path: Path) -> None:
    stale = [
        f"{what} (built from {old}, now {new})"
        for what, old, new in (("data", found.data, expected.data), ("tokenizer", found.tokenizer, expected.tokenizer))
        if old != new
    ]
    if stale:
        raise DrafttrainError(
            f"{path} is stale: it was built for other {' and '.join(stale)}. Rerun `drafttrain prepare` to rebuild it."
        )
