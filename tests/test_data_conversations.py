"""Normalising every real data file into the one conversation schema, bad inputs, and mixing sources."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig, SourceConfig
from drafttrain.data.conversations import ROLES, conversation_hash, load_conversations
from drafttrain.data.sources import allocate, load_mixture, validation_size

# file -> (records, conversations, prompt-only conversations)
REAL_FILES = {
    "data/train/alpaca_en_demo.json": (999, 999, 0),
    "data/train/code_alpaca_2k.json": (2017, 2017, 2),  # two rows with an empty output
    "data/train/glaive_toolcall_demo.json": (300, 300, 0),
    "data/train/gpteacher_codegen.json": (4535, 4535, 0),
    "data/train/gpteacher_roleplay.json": (1923, 1923, 0),
    "data/train/gpteacher_toolformer.json": (7673, 7673, 0),
    "data/train/gsm8k_train.jsonl": (7473, 7473, 0),
    "data/train/mbpp.jsonl": (974, 974, 0),
    "data/train/self_instruct_seed.jsonl": (175, 175, 0),
    "data/train/self_instruct_user.jsonl": (252, 252, 0),
    "eval/mt_bench.jsonl": (80, 80, 80),
    "eval/humaneval.jsonl": (80, 80, 80),
    "eval/gsm8k.jsonl": (80, 80, 80),
    "eval/alpaca.jsonl": (80, 80, 80),
    "data/train/long_context_train.jsonl": (102, 102, 102),
    "eval/long_context.jsonl": (24, 24, 24),
}


@pytest.fixture(scope="module")
def loaded(repo_data):
    return {rel: load_conversations(str(repo_data / rel)) for rel in REAL_FILES}


def test_every_real_file_loads_into_the_schema(loaded, repo_data):
    shipped = [*repo_data.glob("data/train/*.json*"), *repo_data.glob("eval/*.json*")]
    assert sorted(REAL_FILES) == sorted(str(p.relative_to(repo_data)) for p in shipped)
    for rel, (records, convs, prompt_only) in REAL_FILES.items():
        src = loaded[rel]
        assert (src.records, len(src.conversations), sum(c["needs_response"] for c in src.conversations)) == (
            records, convs, prompt_only), rel
        assert src.skipped == Counter(), rel
        ids = [c["id"] for c in src.conversations]
        assert len(set(ids)) == len(ids) and all(i.startswith(src.name + ":") for i in ids)
        for c in src.conversations:
            assert set(c) <= {"id", "source", "messages", "needs_response", "tools"}
            assert c["source"] == src.name
            for m in c["messages"]:
                assert m["role"] in ROLES and isinstance(m["content"], str) and "\r" not in m["content"]


def test_alpaca_joins_instruction_and_input(loaded):
    first = loaded["data/train/code_alpaca_2k.json"].conversations[0]
    assert first["messages"] == [
        {"role": "user", "content": "What are the distinct values from the given list?\n\ndataList = [3, 9, 3, 5, 7, 9, 5]"},
        {"role": "assistant", "content": "The distinct values from the given list are 3, 5, 7 and 9."},
    ]
    crepes = loaded["data/train/alpaca_en_demo.json"].conversations[0]["messages"]
    assert crepes[0] == {"role": "user", "content": "Describe a process of making crepes."}  # empty input: no blank line
    empty = [c for c in loaded["data/train/code_alpaca_2k.json"].conversations if c["needs_response"]]
    assert [c["id"] for c in empty] == ["code_alpaca_2k:237", "code_alpaca_2k:1859"]
    assert [m["role"] for m in empty[0]["messages"]] == ["user"]


def test_gpteacher_response_and_toolformer_example_input(loaded):
    first = loaded["data/train/gpteacher_toolformer.json"].conversations[0]["messages"]
    assert first[0]["content"].endswith("Provide a summary of a famous historical event based on the input event given"
                                        "\n\nFrench Revolution")
    assert first[1] == {"role": "assistant",
                        "content": "Summary of the French Revolution: wikipedia('French Revolution')"}


def test_sharegpt_glaive_tool_calls(loaded):
    convs = loaded["data/train/glaive_toolcall_demo.json"].conversations
    roles = Counter(m["role"] for c in convs for m in c["messages"])
    assert roles == Counter({"assistant": 746 + 211, "user": 746, "tool": 211})
    calls = [m for c in convs for m in c["messages"] if m.get("tool_calls")]
    assert len(calls) == 211 and all(m["role"] == "assistant" and m["content"] == "" for m in calls)
    first = convs[0]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "user", "assistant", "tool", "assistant",
                                                      "user", "assistant"]
    assert first["messages"][3]["tool_calls"] == [{"type": "function", "function": {
        "name": "search_recipes", "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}}]
    assert json.loads(first["tools"])[0]["name"] == "search_recipes"  # kept as the dataset gives it


def test_gsm8k_strips_calculator_annotations(loaded):
    c = loaded["data/train/gsm8k_train.jsonl"].conversations[0]
    assert c["messages"][1]["content"] == ("Natalia sold 48/2 = 24 clips in May.\n"
                                           "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")
    assert not any("<<" in c["messages"][1]["content"] for c in loaded["data/train/gsm8k_train.jsonl"].conversations)


def test_mbpp_prompt_has_the_tests_and_code_has_lf(loaded):
    c = loaded["data/train/mbpp.jsonl"].conversations[0]
    assert c["messages"][0]["content"] == (
        "You are an expert Python programmer, and here is your task: Write a function to find the minimum cost path "
        "to reach (m, n) from (0, 0) for the given cost matrix cost[][] and a position (m, n) in cost[][]. Your code "
        "should pass these tests:\n\n"
        "assert min_cost([[1, 2, 3], [4, 8, 2], [1, 5, 3]], 2, 2) == 8\n"
        "assert min_cost([[2, 3, 4], [5, 9, 3], [2, 6, 4]], 2, 2) == 12\n"
        "assert min_cost([[3, 4, 5], [6, 10, 4], [3, 7, 5]], 2, 2) == 16")
    answer = c["messages"][1]["content"]
    assert answer.startswith("```python\nR = 3\nC = 3\ndef min_cost(cost, m, n): \n\ttc = ") and answer.endswith(
        "\treturn tc[m][n]\n```")


def test_self_instruct_one_conversation_per_instance(loaded):
    c = loaded["data/train/self_instruct_user.jsonl"].conversations[0]
    assert c["id"] == "self_instruct_user:0.0"
    assert c["messages"][0]["content"].startswith("The sentence you are given might be too wordy")
    assert c["messages"][0]["content"].endswith("\n\nIf you have any questions about my rate or if you find it "
                                                "necessary to increase or decrease the scope for this project, please "
                                                "let me know.")
    assert c["messages"][1]["content"].startswith("If you have any questions about my rate or find it necessary")


def test_fastchat_questions_are_prompt_only(loaded):
    mt = loaded["eval/mt_bench.jsonl"].conversations[0]
    assert mt["needs_response"] is True and mt["id"] == "mt_bench:0"
    assert [m["role"] for m in mt["messages"]] == ["user", "user"]
    assert mt["messages"][1]["content"] == "Rewrite your previous response. Start every sentence with the letter A."


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "Be nice."},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                     "tool_calls": [{"id": "c1", "type": "function", "function": {
                                                         "name": "f", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "content": "1"}, {"role": "assistant", "content": [{"type": "text", "text": "one"}]}]},
    {"instruction": "Add.", "input": "1+1", "output": "2", "history": [["Hi", "Hello"]]},
    {"question": "2*3?", "answer": "6 <<2*3=6>>"},
]


def test_openai_sharegpt_alpaca_forms(tmp_path):
    convs = load_conversations(str(_write_jsonl(tmp_path / "mixed.jsonl", RECORDS))).conversations
    assert convs[0]["messages"] == [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}]
    assert convs[1]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert convs[1]["messages"][3] == {"role": "assistant", "content": "one"}
    assert [m["content"] for m in convs[2]["messages"]] == ["Hi", "Hello", "Add.\n\n1+1", "2"]
    assert convs[3]["messages"][1]["content"] == "6 "


@pytest.mark.parametrize("suffix", [".json", ".json.gz", ".jsonl.gz", ".parquet", ".parquet.gz"])
def test_file_kinds_load_the_same(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]
    path = tmp_path / f"data{suffix}"
    if ".parquet" in suffix:
        pq.write_table(pa.Table.from_pylist(records), tmp_path / "plain.parquet")
        raw = (tmp_path / "plain.parquet").read_bytes()
    elif suffix.startswith(".jsonl"):
        raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    else:
        raw = json.dumps(records).encode()
    path.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    src = load_conversations(str(path))
    assert src.name == "data"
    assert [c["messages"][0]["content"] for c in src.conversations] == [f"q{i}" for i in range(5)]


def test_skips_are_counted_with_reasons(tmp_path):
    records = [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "narrator", "value": "b"}]},
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "b"}]},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "fine"}]},
    ]
    src = load_conversations(str(_write_jsonl(tmp_path / "s.jsonl", records)))
    assert len(src.conversations) == 1 and src.records == 5
    assert src.skipped == Counter({"unknown role 'narrator'": 1, "no messages": 1, "empty user turn": 1,
                                   "no user turn": 1})


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.jsonl", None, r"data file not found: .*missing\.jsonl"),
        ("data.csv", "a,b\n1,2\n", r"data\.csv: unknown extension"),
        ("empty.jsonl", "", r"empty\.jsonl is empty"),
        ("blank.json", "[]", r"blank\.json is empty"),
        ("bad.jsonl", '{"question": "a", "answer": "b"}\n{oops\n', r"bad\.jsonl: line 2 is not valid JSON"),
        ("obj.json", '{"a": 1, "b": 2}', r"obj\.json: expected a JSON array"),
        ("odd.jsonl", '{"foo": 1, "bar": 2}\n', r"odd\.jsonl: record 0 does not fit: .*keys seen: \['bar', 'foo'\]"),
        ("scalar.jsonl", "3\n", r"scalar\.jsonl: record 0 is a int"),
        ("bad.json.gz", "not gzip", r"bad\.json\.gz: not a valid gzip file"),
    ],
)
def test_bad_inputs_name_the_file_and_cause(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DrafttrainError, match=match):
        load_conversations(str(path))


def test_forced_format_mismatch_and_unknown_format(repo_data):
    path = str(repo_data / "data/train/gsm8k_train.jsonl")
    with pytest.raises(DrafttrainError, match=r"record 0 does not fit: format 'alpaca' needs a key 'instruction'; "
                                              r"keys seen: \['answer', 'question'\]"):
        load_conversations(path, "alpaca")
    with pytest.raises(DrafttrainError, match="unknown data format 'csv'"):
        load_conversations(path, "csv")
    assert len(load_conversations(path, "gsm8k").conversations) == 7473


def test_unreachable_hub_dataset_says_how_to_use_a_local_file(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # No Hub here; offline mode makes the failure immediate instead of retrying DNS for ~20 s.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DrafttrainError, match=r"could not load dataset 'HuggingFaceH4/ultrachat_200k'.*"
                                              r"split='train_sft'.*copy the file here and set the source path"):
        load_conversations("HuggingFaceH4/ultrachat_200k", split="train_sft")


# ----------------------------------------------------------------------------------------------- mixing


def _cfg(repo_data: Path, *sources: dict, **kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(**dict(s, path=str(repo_data / s["path"]))) for s in sources], **kw)


def test_mixture_weights_caps_and_split(repo_data):
    cfg = _cfg(repo_data, {"path": "data/train/gsm8k_train.jsonl", "weight": 3}, {"path": "data/train/mbpp.jsonl"},
               {"path": "data/train/self_instruct_seed.jsonl", "max_samples": 10}, num_samples=2000,
               validation_fraction=0.05)
    mix = load_mixture(cfg, seed=0)
    taken = {name: s["taken"] for name, s in mix.stats["sources"].items()}
    # 2000 * (3, 1, 1)/5 = 1200/400/400, self_instruct capped at 10 -> its 390 go to the others 3:1.
    assert taken == {"gsm8k_train": 1493, "mbpp": 497, "self_instruct_seed": 10}
    assert mix.stats["sources"]["self_instruct_seed"]["short_by"] == 390
    assert (len(mix.train), len(mix.validation)) == (1900, 100) == (mix.stats["train"], mix.stats["validation"])
    assert not {c["id"] for c in mix.train} & {c["id"] for c in mix.validation}
    assert Counter(c["source"] for c in mix.train + mix.validation) == Counter(taken)
    assert "gsm8k_train: 7473 loaded from 7473 records, took 1493" in mix.summary()
    assert all("_hash" not in c for c in mix.train)


def test_mixture_is_deterministic_and_independent_of_source_order(repo_data):
    a = {"path": "data/train/mbpp.jsonl"}
    b = {"path": "data/train/self_instruct_user.jsonl"}
    m1 = load_mixture(_cfg(repo_data, a, b, num_samples=300), seed=7)
    m2 = load_mixture(_cfg(repo_data, b, a, num_samples=300), seed=7)
    m3 = load_mixture(_cfg(repo_data, a, b, num_samples=300), seed=8)
    ids = lambda m: ([c["id"] for c in m.train], [c["id"] for c in m.validation])  # noqa: E731
    assert ids(m1) == ids(m2)
    assert ids(m1) != ids(m3)
    # More samples extend the selection per source instead of redrawing it.
    m4 = load_mixture(_cfg(repo_data, a, b, num_samples=400), seed=7)
    assert {c["id"] for c in m1.train + m1.validation} <= {c["id"] for c in m4.train + m4.validation}


def test_mixture_does_not_depend_on_python_hash_randomisation(tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(50)])
    code = ("from drafttrain.config import DataConfig, SourceConfig\nfrom drafttrain.data.sources import load_mixture\n"
            f"m = load_mixture(DataConfig(sources=[SourceConfig(path={str(data)!r})], validation_fraction=0.1), 3)\n"
            "print([c['id'] for c in m.train], [c['id'] for c in m.validation])")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin",
                                "PYTHONPATH": str(Path(__file__).resolve().parents[1])}).stdout
            for seed in ("1", "2")]
    assert outs[0] == outs[1] and "d:" in outs[0]


def test_dedupe_across_sources_and_everything_when_no_num_samples(repo_data, tmp_path):
    cfg = _cfg(repo_data, {"path": "data/train/mbpp.jsonl"}, {"path": "data/train/mbpp.jsonl"}, validation_fraction=0)
    mix = load_mixture(cfg, seed=0)
    assert len(mix.train) == 974 and mix.validation == [] and mix.stats["deduped"] == 974
    assert mix.stats["sources"]["mbpp#2"]["duplicates"] == 974
    no_dedupe = load_mixture(cfg.model_copy(update={"dedupe": False}), seed=0)
    assert len(no_dedupe.train) == 2 * 974
    # Duplicates are judged on user+assistant content, whitespace-normalised, not on ids.
    one = {"id": "x:1", "source": "x", "messages": [{"role": "user", "content": "a  b"}]}
    two = {"id": "y:9", "source": "y", "messages": [{"role": "system", "content": "s"},
                                                    {"role": "user", "content": "a b\n"}]}
    assert conversation_hash(one) == conversation_hash(two)


def test_all_real_training_files_mix(repo_data):
    sources = [{"path": f"data/train/{p.name}"} for p in sorted((repo_data / "data" / "train").glob("*.json*"))]
    mix = load_mixture(_cfg(repo_data, *sources), seed=0)
    n = sum(v[1] for k, v in REAL_FILES.items() if k.startswith("data/train/"))
    assert mix.stats["train"] + mix.stats["validation"] + mix.stats["deduped"] == n
    assert mix.stats["validation"] == round((n - mix.stats["deduped"]) * 0.05)
    assert mix.stats["prompt_only"] == 2 + 102  # code_alpaca's two empty answers, the long-context prompts


def test_empty_mixture_is_an_error_naming_the_reasons(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"conversations": []}, {"conversations": [{"from": "gpt", "value": "x"}]}])
    with pytest.raises(DrafttrainError, match=r"mixture is empty.*bad: 0 loaded.*no messages"):
        load_mixture(DataConfig(sources=[SourceConfig(path=str(path))]), seed=0)


def test_allocate_and_validation_size():
    assert allocate(10, [1, 1, 1], [100, 100, 100]) == [4, 3, 3]
    assert allocate(10, [1, 1], [2, 100]) == [2, 8]
    assert allocate(500, [1, 1], [2, 100]) == [2, 100]
    assert (validation_size(1, 0.5), validation_size(10, 0.01), validation_size(10, 0), validation_size(100, 0.05)) == (
        0, 1, 0, 5)
