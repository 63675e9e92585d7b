"""The tokenised Arrow dataset: columns, stats, cache hits, and a new key for every input that shapes it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig, SourceConfig
from drafttrain.data.conversations import load_conversations
from drafttrain.data.tokenize import build_tokenized_dataset, cache_key, tokenize_conversation

TEMPLATES = Path(__file__).parent / "templates"


@pytest.fixture(scope="module")
def smol():
    from drafttrain.targets import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def conversations(repo_data):
    gsm = load_conversations(str(repo_data / "data/train/gsm8k_train.jsonl")).conversations[:24]
    glaive = load_conversations(str(repo_data / "data/train/glaive_toolcall_demo.json")).conversations[:6]
    prompt_only = load_conversations(str(repo_data / "eval/mt_bench.jsonl")).conversations[:2]
    return gsm + glaive + prompt_only


def _cfg(**kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(path="unused.jsonl")], **dict({"max_length": 512}, **kw))


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tokenized").iterdir())


def test_build_columns_rows_and_stats(smol, conversations, tmp_path):
    ds, stats = build_tokenized_dataset(conversations, smol, _cfg(), tmp_path)
    assert ds.column_names == ["input_ids", "loss_mask", "conversation_id", "num_tokens", "num_trainable"]
    assert stats["cache_hit"] is False and stats["conversations"] == 32 and stats["tokenized"] == 30 == len(ds)
    assert stats["skipped"] == {"prompt-only (needs_response): no assistant turn to train on": 2}
    assert ds["conversation_id"] == [c["id"] for c in conversations[:30]]
    for i in (0, 27):
        expected = tokenize_conversation(smol, conversations[i], 512)
        row = ds[i]
        assert (row["input_ids"], row["loss_mask"]) == (expected["input_ids"], expected["loss_mask"])
        assert (row["num_tokens"], row["num_trainable"]) == (len(expected["input_ids"]), sum(expected["loss_mask"]))
    assert stats["tokens"] == sum(ds["num_tokens"]) and stats["trainable_tokens"] == sum(ds["num_trainable"])
    assert _dirs(tmp_path) == [stats["cache_key"]]  # atomic write: no temp or work folders left behind


def test_same_inputs_hit_the_cache(smol, conversations, tmp_path):
    first, stats1 = build_tokenized_dataset(conversations, smol, _cfg(), tmp_path)
    marker = Path(stats1["cache_path"]) / "drafttrain_stats.json"
    mtime = marker.stat().st_mtime_ns
    again, stats2 = build_tokenized_dataset([dict(c) for c in conversations], smol, _cfg(), tmp_path)
    assert stats2["cache_hit"] is True and stats2["cache_path"] == stats1["cache_path"]
    assert marker.stat().st_mtime_ns == mtime  # not rebuilt
    assert again["input_ids"] == first["input_ids"] and again["loss_mask"] == first["loss_mask"]
    assert {k: v for k, v in stats2.items() if k != "cache_hit"} == {k: v for k, v in stats1.items() if k != "cache_hit"}


def test_everything_that_shapes_the_result_changes_the_key(smol, conversations):
    base = cache_key(conversations, smol, _cfg())
    qwen_template = copy.deepcopy(smol)
    qwen_template.chat_template = (TEMPLATES / "qwen2.5_instruct.jinja").read_text()
    more_tokens = copy.deepcopy(smol)
    more_tokens.add_tokens(["<|eot_id|>"], special_tokens=True)
    edited = [dict(c) for c in conversations]
    edited[3] = dict(edited[3], messages=[dict(m) for m in edited[3]["messages"]])
    edited[3]["messages"][-1]["content"] += " "
    keys = {
        "base": base,
        "max_length": cache_key(conversations, smol, _cfg(max_length=1024)),
        "overlength": cache_key(conversations, smol, _cfg(overlength="drop")),
        "packing": cache_key(conversations, smol, _cfg(packing=True)),
        "template": cache_key(conversations, qwen_template, _cfg()),
        "tokenizer": cache_key(conversations, more_tokens, _cfg()),
        "data_edit": cache_key(edited, smol, _cfg()),
        "data_drop": cache_key(conversations[1:], smol, _cfg()),
    }
    assert len(set(keys.values())) == len(keys)
    # ... and nothing else does: sources / num_samples / seed only matter through the conversations themselves.
    assert cache_key(conversations, copy.deepcopy(smol), _cfg(num_samples=5, validation_fraction=0.2)) == base


def test_changed_inputs_rebuild(smol, conversations, tmp_path):
    _, s1 = build_tokenized_dataset(conversations, smol, _cfg(), tmp_path)
    ds2, s2 = build_tokenized_dataset(conversations, smol, _cfg(max_length=64), tmp_path)
    qwen_template = copy.deepcopy(smol)
    qwen_template.chat_template = (TEMPLATES / "qwen2.5_instruct.jinja").read_text()
    ds3, s3 = build_tokenized_dataset(conversations[:10], qwen_template, _cfg(), tmp_path)
    assert (s2["cache_hit"], s3["cache_hit"]) == (False, False)
    assert len({s1["cache_key"], s2["cache_key"], s3["cache_key"]}) == 3
    assert _dirs(tmp_path) == sorted([s1["cache_key"], s2["cache_key"], s3["cache_key"]])
    assert max(ds2["num_tokens"]) == 64
    assert "You are Qwen" in qwen_template.decode(ds3[0]["input_ids"])


def test_packed_dataset(smol, conversations, tmp_path):
    ds, stats = build_tokenized_dataset(conversations, smol, _cfg(packing=True), tmp_path)
    assert ds.column_names == ["input_ids", "loss_mask", "position_ids", "conversation_ids", "num_tokens",
                               "num_trainable"]
    assert stats["rows"] == len(ds) < stats["tokenized"] == 30
    assert sorted(i for ids in ds["conversation_ids"] for i in ids) == sorted(c["id"] for c in conversations[:30])
    assert all(n <= 512 for n in ds["num_tokens"]) and sum(ds["num_tokens"]) == stats["tokens"]
    for row in ds:
        assert sum(p == 0 for p in row["position_ids"]) == len(row["conversation_ids"])


def test_nothing_tokenisable_is_an_error(smol, conversations, tmp_path):
    with pytest.raises(DrafttrainError, match=r"no conversation could be tokenised \(prompt-only"):
        build_tokenized_dataset(conversations[-2:], smol, _cfg(), tmp_path)
    assert _dirs(tmp_path) == []  # a failed build leaves nothing behind
