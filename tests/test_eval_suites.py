"""Question suites: built-ins load, selection is deterministic, bad files fail with the cause named."""

from __future__ import annotations

import json

import pytest

from drafttrain import DrafttrainError
from drafttrain.evaluation.suites import BUILTIN_SUITES, COPIED_SUITES, load_suite, suite_dir


@pytest.mark.parametrize("name", BUILTIN_SUITES)
def test_builtin_suites_load(name):
    suite = load_suite(name)
    assert len(suite) == (24 if name == "long_context" else 80)
    assert all(q.turns and q.category for q in suite.questions)


def test_builtin_files_are_the_published_files_their_sources_name():
    """Each copied suite hashes to the sha256 eval/SOURCES.md records for the public file it copies."""
    import hashlib
    import re

    sources = (suite_dir() / "SOURCES.md").read_text()
    for name in COPIED_SUITES:
        row = next(line for line in sources.splitlines() if line.startswith(f"| `{name}.jsonl`"))
        recorded = re.findall(r"`([0-9a-f]{64})`", row)
        assert recorded == [hashlib.sha256((suite_dir() / f"{name}.jsonl").read_bytes()).hexdigest()], name


def test_mt_bench_shape_and_selection():
    suite = load_suite("mt_bench")
    assert {len(q.turns) for q in suite.questions} == {2}
    assert len({q.category for q in suite.questions}) == 8
    first = suite.select(3, turns="1")
    # round-robin over categories, file order within each: a small slice covers several categories
    assert [q.question_id for q in first.questions] == ["81", "91", "101"]
    assert [q.category for q in suite.select(8).questions] == [
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    assert [q.question_id for q in suite.select(9).questions][-1] == "82"
    assert {len(q.turns) for q in first.questions} == {1}
    assert suite.select(3).questions == suite.select(3).questions
    assert len(suite.select(None)) == 80 and len(suite.select(500)) == 80


def test_empty_category_falls_back_to_suite_name():
    assert {q.category for q in load_suite("alpaca").questions} == {"alpaca"}


def test_custom_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"question_id": 1, "category": "x", "turns": ["hello"]}, {"question_id": 2, "turns": ["a", "b"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    suite = load_suite(str(path))
    assert [q.category for q in suite.questions] == ["x", "mine"]
    assert suite.questions[1].turns == ("a", "b")


def test_unknown_suite_is_named():
    with pytest.raises(DrafttrainError, match="unknown suite 'mtbench'"):
        load_suite("mtbench")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DrafttrainError, match="not found"):
        load_suite(str(tmp_path / "nope.jsonl"))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DrafttrainError, match="empty prompt set"):
        load_suite(str(path))


@pytest.mark.parametrize(
    "line, cause",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"question_id": 1, "turns": []}', "'turns'"),
        ('{"question_id": 1, "turns": "just a string"}', "'turns'"),
        ('{"turns": ["hi"]}', "question_id"),
    ],
)
def test_malformed_file_names_file_line_and_cause(tmp_path, line, cause):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question_id": 0, "turns": ["ok"]}\n' + line + "\n")
    with pytest.raises(DrafttrainError, match="malformed") as err:
        load_suite(str(path))
    assert f"{path}:2" in str(err.value) and cause in str(err.value)


def test_bad_selection():
    with pytest.raises(DrafttrainError, match="num-prompts"):
        load_suite("gsm8k").select(0)
    with pytest.raises(DrafttrainError, match="turns"):
        load_suite("gsm8k").select(2, turns="3")


def test_depth_auto_calibrates_on_the_served_suites_own_unreported_prompts():
    from drafttrain.evaluation.suites import served_kind

    reported = load_suite("mt_bench").select(6, turns="1")
    chosen = served_kind(reported, 4)
    firsts = {q.turns[0] for q in reported.questions}
    assert len(chosen) == 4 and not firsts & {q.turns[0] for q in chosen}
    assert len({q.category for q in chosen}) == 4  # one category at a time
    assert served_kind(load_suite("mt_bench").select(turns="1"), 4) == ()  # every prompt reported: none left


def test_the_long_context_suite_fills_every_long_bucket_and_fits_smollm2s_context(smollm2):
    """24 prompts of 2k-8k tokens as the evaluator renders them (chat template included), both kinds in each of the
    2k-4k, 4k-8k ranges, each leaving room for a 256-token answer in SmolLM2's 8k context; the training rows never
    share a source file or topic with the suite."""
    from drafttrain.data.chat import prompt_ids

    suite = load_suite("long_context")
    lengths = {q.question_id: len(prompt_ids(smollm2.tokenizer, [{"role": "user", "content": q.turns[0]}]))
               for q in suite.questions}
    assert 2048 <= min(lengths.values()) and max(lengths.values()) + 256 <= 8192, lengths
    for category in ("long_code", "long_docs"):
        mine = [n for q, n in zip(suite.questions, lengths.values()) if q.category == category]
        assert len(mine) == 12 and any(n < 4096 for n in mine) and any(n >= 4096 for n in mine)
    rows = [json.loads(line) for line in (suite_dir() / "long_context.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in
             (suite_dir().parent / "data" / "train" / "long_context_train.jsonl").read_text().splitlines()]
    assert len(train) >= 40 and not {r["source"] for r in rows} & {r["source"] for r in train}
