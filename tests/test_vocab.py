"""Draft vocabulary: selection rules, the EAGLE-3 d2t/t2d layout, keys against stale mappings, real data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.data.tokenize import tokenizer_fingerprint
from drafttrain.data.vocab import (
    DraftVocabKey,
    build_draft_vocab,
    build_mapping,
    count_trainable_tokens,
    dataset_coverage,
    load_draft_vocab,
    save_draft_vocab,
    select_draft_ids,
)


class FakeTokenizer:
    def __init__(self, size: int):
        self.vocab = {f"t{i}": i for i in range(size)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def rows(*pairs):
    return [{"input_ids": ids, "loss_mask": mask} for ids, mask in pairs]


# Token 5 is frequent but never trainable (a prompt token); 7 > 3 > 1 = 9 among trainable ones.
SYNTHETIC = rows(
    ([5, 5, 5, 7, 7, 3], [0, 0, 0, 1, 1, 1]),
    ([5, 5, 7, 7, 3, 1, 9], [0, 0, 1, 1, 1, 1, 1]),
    ([5, 7], [0, 1]),
)


def test_counts_only_trainable_tokens():
    counts = count_trainable_tokens(SYNTHETIC, vocab_size=12)
    expected = np.zeros(12, dtype=np.int64)
    expected[[7, 3, 1, 9]] = [5, 2, 1, 1]
    assert counts.counts.tolist() == expected.tolist()
    assert counts.total == 9 and counts.distinct == 4


def test_top_n_with_ties_to_lower_id_and_ascending_draft_order():
    counts = count_trainable_tokens(SYNTHETIC, vocab_size=12).counts
    # top 3: 7 (5), 3 (2), then 1 and 9 tie at 1 -> the lower id 1 wins; draft ids follow target ids ascending.
    assert select_draft_ids(counts, 3).tolist() == [1, 3, 7]


def test_fill_beyond_seen_tokens_uses_lowest_unseen_ids():
    counts = count_trainable_tokens(SYNTHETIC, vocab_size=12).counts
    selected = select_draft_ids(counts, 7)  # 4 seen + 3 fill: unseen ids 0, 2, 4 (lowest first)
    assert selected.tolist() == [0, 1, 2, 3, 4, 7, 9]


def test_d2t_t2d_layout_matches_eagle3():
    selected = torch.tensor([1, 3, 7, 9])
    d2t, t2d = build_mapping(selected, vocab_size=12)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 2, 5, 6]
    assert (torch.arange(4) + d2t).tolist() == [1, 3, 7, 9]  # target_id = draft_id + d2t[draft_id]
    assert t2d.dtype == torch.bool and t2d.shape == (12,) and torch.nonzero(t2d).flatten().tolist() == [1, 3, 7, 9]


def test_size_larger_than_target_vocab_names_both_sizes():
    with pytest.raises(DrafttrainError, match=r"13.*12"):
        build_draft_vocab(SYNTHETIC, FakeTokenizer(12), vocab_size=12, size=13)


def test_ids_outside_the_vocab_are_an_error():
    with pytest.raises(DrafttrainError, match="outside the target vocabulary"):
        count_trainable_tokens(rows(([1, 20], [1, 1])), vocab_size=12)


def test_save_load_roundtrip_and_stale_key(tmp_path):
    tokenizer = FakeTokenizer(12)
    vocab = build_draft_vocab(SYNTHETIC, tokenizer, vocab_size=12, size=3)
    assert vocab.coverage == pytest.approx((5 + 2 + 1) / 9)
    path = save_draft_vocab(vocab, tmp_path / "draft_vocab.safetensors")
    loaded = load_draft_vocab(path, expect_key=vocab.key)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert (loaded.size, loaded.target_vocab_size, loaded.coverage) == (3, 12, vocab.coverage)

    other_data = count_trainable_tokens(SYNTHETIC[:2], 12).data_hash
    with pytest.raises(DrafttrainError, match="stale.*data"):
        load_draft_vocab(path, expect_key=DraftVocabKey(data=other_data, tokenizer=vocab.key.tokenizer))
    with pytest.raises(DrafttrainError, match="stale.*tokenizer"):
        load_draft_vocab(path, expect_key=DraftVocabKey(data=vocab.key.data, tokenizer=tokenizer_fingerprint(FakeTokenizer(13))))
    with pytest.raises(DrafttrainError, match="not found"):
        load_draft_vocab(tmp_path / "missing.safetensors")


def test_data_hash_depends_on_the_mask_too():
    flipped = rows(([5, 5, 5, 7, 7, 3], [0, 0, 1, 1, 1, 1]), *[(r["input_ids"], r["loss_mask"]) for r in SYNTHETIC[1:]])
    assert count_trainable_tokens(flipped, 12).data_hash != count_trainable_tokens(SYNTHETIC, 12).data_hash


def test_real_data_coverage(tmp_path, repo_data):
    """On real tokenised GSM8K rows: counts match a direct count, and the reported coverage is the real share."""
    from drafttrain.config import DataConfig
    from drafttrain.data.sources import load_mixture
    from drafttrain.data.tokenize import build_tokenized_dataset
    from drafttrain.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    data = DataConfig(sources=[{"path": str(repo_data / "data" / "train" / "gsm8k_train.jsonl")}], num_samples=40,
                      validation_fraction=0.25, max_length=512)
    mixture = load_mixture(data, seed=0)
    train, _ = build_tokenized_dataset(mixture.train, tokenizer, data, tmp_path / "cache")
    validation, _ = build_tokenized_dataset(mixture.validation, tokenizer, data, tmp_path / "cache")
    vocab_size = 49152
    vocab = build_draft_vocab(train, tokenizer, vocab_size, size=256)

    trainable = np.concatenate([np.asarray(r["input_ids"])[np.asarray(r["loss_mask"], bool)] for r in train])
    direct = np.bincount(trainable, minlength=vocab_size)
    assert vocab.trainable_tokens == trainable.size == sum(train["num_trainable"])
    kept = vocab.target_ids().numpy()
    assert vocab.coverage == pytest.approx(direct[kept].sum() / direct.sum())
    assert direct[kept].min() >= np.sort(direct)[::-1][255]  # nothing more frequent was left out
    assert vocab.t2d[tokenizer.convert_tokens_to_ids("<|im_end|>")]  # the end of turn must be predictable
    assert 0.5 < vocab.coverage < 1.0
    assert 0.0 < dataset_coverage(validation, vocab) <= 1.0


def test_a_draft_vocab_sized_by_coverage_is_the_fewest_tokens_reaching_it():
    from drafttrain.data.vocab import size_for_coverage

    counts = torch.zeros(1000, dtype=torch.int64)
    counts[:10] = 100  # 1000 tokens in 10 ids
    counts[10:110] = 1  # 100 more, spread over 100 ids
    total = 1100
    assert size_for_coverage(counts, 1000 / total, multiple=1) == 10
    assert size_for_coverage(counts, 1001 / total, multiple=1) == 11
    assert size_for_coverage(counts, 1.0, multiple=1) == 110
    assert size_for_coverage(counts, 1.0, multiple=64) == 128
    vocab = build_draft_vocab(SYNTHETIC, FakeTokenizer(12), vocab_size=12, size=12, coverage=7 / 9)
    assert vocab.size == 12  # 2 ids reach 7/9, rounded up to 64, at most the vocabulary
    vocab = build_draft_vocab(SYNTHETIC, FakeTokenizer(200), vocab_size=200, size=150, coverage=7 / 9)
    assert vocab.size == 64 and vocab.coverage >= 7 / 9


def test_a_continued_drafts_vocabulary_keeps_its_tokens_and_gains_the_new_datas():
    # the saved draft's tokens 2, 3, 10; the data trains on 1, 3, 7, 9: every one of them, size notwithstanding
    vocab = build_draft_vocab(SYNTHETIC, FakeTokenizer(12), vocab_size=12, size=2, keep=torch.tensor([2, 3, 10]))
    assert vocab.target_ids().tolist() == [1, 2, 3, 7, 9, 10] and vocab.coverage == 1.0
