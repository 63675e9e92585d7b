"""Served traffic as training data: request logs and prompts files read with every unusable line named and
counted, duplicates once, secrets replaced before anything is stored, the target's own logged answers kept and the
others re-answered by the target."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from datasets import load_from_disk

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig, SourceConfig, parse_recipe
from drafttrain.data.sources import load_mixture
from drafttrain.data.traffic import REDACTED, read_prompts_file, read_request_log, redact, traffic_source
from drafttrain.training.prepare import prepare

SECRETS = {
    "api key": ["sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "AKIAIOSFODNN7EXAMPLE",
                "ghp_0123456789abcdefghijABCDEFGHIJ012345", "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"],
    "jwt": ["eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"],
    "private key": ["-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\n-----END RSA PRIVATE KEY-----"],
}


def answer(text: str, model: str, finish: str = "stop") -> dict:
    return {"model": model, "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}]}


def request(*turns: str, system: str | None = None, tools=None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": messages, **({"tools": tools} if tools else {})}


def test_redaction_replaces_each_kind_of_secret_and_keeps_the_text_around_it():
    for kind, values in SECRETS.items():
        for value in values:
            found = Counter()
            assert redact(f"use {value} please", found) == f"use {REDACTED} please" and found[kind] == 1, value
    found = Counter()
    text = ("curl -H 'Authorization: Bearer abcdefghijklmnop1234' https://bob:hunter2secret@db.example.com/x; "
            "password = 'correct-horse' and api_key: Zx81kLmn")
    assert redact(text, found) == (f"curl -H 'Authorization: Bearer {REDACTED}' https://bob:{REDACTED}@db.example"
                                   f".com/x; password = '{REDACTED}' and api_key: {REDACTED}")
    assert found["authorization header"] == 1 and found["url password"] == 1 and found["password"] == 2
    found = Counter()
    lines = ["DB_PASSWORD=hunter22", "client_secret: \"x9y8z7w6\"", "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRf",
             "Authorization: Basic dXNlcjpwYXNzd29yZDEyMzQ=", "redis://:s3cretpw@host:6379", "ASIAIOSFODNN7EXAMPLE"]
    assert [redact(line, found) for line in lines] == [
        f"DB_PASSWORD={REDACTED}", f"client_secret: \"{REDACTED}\"", f"AWS_SECRET_ACCESS_KEY={REDACTED}",
        f"Authorization: Basic {REDACTED}", f"redis://:{REDACTED}@host:6379", REDACTED]
    ordinary = ["The password policy needs 12 characters; sk-learn is a library; see https://example.com/a:b",
                'password = input("Password: ")', 'api_key = os.environ["OPENAI_API_KEY"]', "secret = get_secret()",
                "Secret: Remember the rule", f'api_key = "{REDACTED}"']
    found = Counter()
    assert [redact(line, found) for line in ordinary] == ordinary and not +found  # code and prose about secrets


def test_a_request_log_names_and_counts_bad_lines_keeps_each_request_once_and_redacts_before_storing(tmp_path):
    key = SECRETS["api key"][0]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    lines = [
        json.dumps({"request": request("What is 2+2?", system="Be brief."), "response": answer("4", "smollm2")}),
        json.dumps({"request": request("What is 2+2?", system="Be brief."), "response": answer("four", "gpt-x")}),
        "{not json",
        json.dumps({"custom_id": "b1", "body": request(f"my key is {key}, why 401?", tools=tools),
                    "response": {"status_code": 200, "body": answer(f"Rotate {key} now.", "gpt-x")}}),
        json.dumps(request("Write a poem", "Roses...", "Longer please")),
        json.dumps({"request": request("Summarise this"), "response": answer("It is about", "gpt-x", "length")}),
        json.dumps({"request": {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                                             {"role": "assistant", "content": "", "tool_calls": [
                                                 {"type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                                             {"role": "tool", "content": "rain"}]},
                    "response": answer("It rains.", "smollm2")}),
        json.dumps({"prompt": "a completions request"}),
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}),
    ]
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(lines) + "\n")
    loaded, read = traffic_source(str(path), "request_log", "traffic")
    assert read.skipped == ["line 3: not JSON (Expecting property name enclosed in double quotes)",
                            "line 8: no messages (not a chat completions request)",
                            "line 9: unknown role 'narrator'"]
    assert read.duplicates == 1 and loaded.records == 9
    assert loaded.skipped == Counter({"not JSON": 1, "no messages": 1, "unknown role 'narrator'": 1,
                                      "duplicate request": 1})
    first, batch, poem, cut, tool_loop = loaded.conversations
    assert first["messages"][0] == {"role": "system", "content": "Be brief."}
    assert first["messages"][-1]["content"] == "4" and first["answered_by"] == "smollm2"
    assert not first["needs_response"]
    assert batch["tools"] == tools and batch["answered_by"] == "gpt-x"
    assert key not in json.dumps(loaded.conversations) and read.redacted == Counter({"api key": 2})
    assert [m["role"] for m in poem["messages"]] == ["user", "assistant", "user"] and poem["needs_response"]
    assert cut["needs_response"] and "answered_by" not in cut  # an answer cut at its length limit is not kept
    # the logged answer replied to the tool's result, which the prompt (up to the user turn) leaves out
    assert tool_loop["needs_response"] and [m["role"] for m in tool_loop["messages"]] == ["user"]
    path.write_text("{broken\n")
    with pytest.raises(DrafttrainError, match="no usable request.*line 1: not JSON"):
        read_request_log(path)


def test_a_prompts_file_gives_each_prompt_once_and_names_what_it_cannot_read(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("How do I sort a list?\n\nHow do I sort a list?\nWhat is my token hf_abcdefghijklmnopqrstuvwxyzABCD\n")
    read = read_prompts_file(text)
    assert [p.messages[0]["content"] for p in read.prompts] == ["How do I sort a list?", f"What is my token {REDACTED}"]
    assert read.duplicates == 1 and read.redacted == Counter({"api key": 1})
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('"plain string"\n{"prompt": "an object"}\n{"text": "other key"}\n[1]\n')
    read = read_prompts_file(lines)
    assert [p.messages[0]["content"] for p in read.prompts] == ["plain string", "an object"]
    assert [s.split(":")[0] for s in read.skipped] == ["line 3", "line 4"]


@pytest.mark.slow
def test_prepare_keeps_the_targets_own_logged_answers_and_has_the_target_answer_the_rest(tmp_path, smollm2):
    key = SECRETS["api key"][1]
    lines = [json.dumps({"request": request(f"Question {i}: name a colour. My AWS key is {key}."),
                         "response": answer(f"Logged answer {i} with {key}", model)})
             for i, model in enumerate(["smollm2-135m-instruct", "another-model", "smollm2-135m-instruct"])]
    lines.append(json.dumps(request("Name a fruit.")))
    (tmp_path / "traffic.jsonl").write_text("\n".join(lines) + "\n")
    recipe = parse_recipe({
        "output_dir": str(tmp_path / "run"), "target": {"model": "smollm2-135m-instruct"},
        "data": {"sources": [{"path": str(tmp_path / "traffic.jsonl"), "format": "request_log"}],
                 "validation_fraction": 0.0, "max_length": 256},
        "regenerate": {"enabled": True, "max_new_tokens": 8, "batch_size": 4}})
    result = prepare(recipe, target=smollm2, progress=False, show_summary=False)
    assert result.summary["regenerate"]["regenerated_now"] == 2  # another model's answer, and the unanswered one
    assert result.summary["sources"]["traffic"]["regenerated"] == 2
    rows = load_from_disk(str(tmp_path / "run" / "data" / "train"))
    texts = {cid: smollm2.tokenizer.decode(ids) for cid, ids in zip(rows["conversation_id"], rows["input_ids"])}
    assert len(texts) == 4
    assert f"Logged answer 0 with {REDACTED}" in texts["traffic:0"] and "Logged answer 2" in texts["traffic:2"]
    assert "Logged answer 1" not in texts["traffic:1"]  # re-answered by the target
    stored = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file()
                     and p.suffix in (".jsonl", ".json", ".arrow"))
    assert key not in stored and all(key not in t for t in texts.values())


def test_a_mixture_names_the_lines_it_skipped_and_counts_what_it_redacted(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([json.dumps(request("Hello there")), "{oops",
                               json.dumps(request(f"key {SECRETS['api key'][2]} fails")), json.dumps(request("Hello there"))]))
    with caplog.at_level("WARNING", logger="drafttrain.data.sources"):
        mixture = load_mixture(DataConfig(sources=[SourceConfig(path=str(path), format="request_log")],
                                          validation_fraction=0.0), seed=0)
    stats = mixture.stats["sources"]["log"]
    assert stats["records"] == 4 and stats["loaded"] == 2 and stats["redacted"] == {"api key": 1}
    assert stats["skipped"] == {"not JSON": 1, "duplicate request": 1}
    assert any("line 2: not JSON" in r.getMessage() for r in caplog.records)
    assert all(SECRETS["api key"][2] not in json.dumps(c) for c in mixture.train)


PHRASED = {"aws": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "password": "Tr0ub4dor&3x",
           "json key": "sk-proj-AbCdEfGhIjKlMnOpQrStUvWx0123"}


def test_secrets_in_ordinary_phrasing_never_reach_any_file_prepare_writes(tmp_path, smollm2, monkeypatch):
    """"my AWS secret access key is <40 chars>", "my password is <pw>", and a key used as a JSON object key passed
    redaction and were written in clear into the run folder and the answer store every later run reads. Every
    file prepare writes, the answer store's included, is read byte for byte."""
    store = tmp_path / "answers"
    monkeypatch.setenv("DRAFTTRAIN_ANSWER_STORE", str(store))
    lines = [json.dumps({"request": request(f"My AWS secret access key is {PHRASED['aws']}. Store it safely.")}),
             json.dumps({"request": request(f"Reset it: my password is {PHRASED['password']}, thanks.")}),
             json.dumps({"request": {**request("Summarise the config."), "metadata": {PHRASED["json key"]: "x"}},
                         "response": answer("A config with one key.", "smollm2-135m-instruct")})]
    (tmp_path / "traffic.jsonl").write_text("\n".join(lines) + "\n")
    recipe = parse_recipe({
        "output_dir": str(tmp_path / "run"), "target": {"model": "smollm2-135m-instruct"},
        "data": {"sources": [{"path": str(tmp_path / "traffic.jsonl"), "format": "request_log"}],
                 "validation_fraction": 0.0, "max_length": 256},
        "regenerate": {"enabled": True, "max_new_tokens": 8, "batch_size": 4}})
    result = prepare(recipe, target=smollm2, progress=False, show_summary=False)
    assert result.summary["regenerate"]["regenerated_now"] == 2
    written = [p for folder in (tmp_path / "run", store) for p in folder.rglob("*") if p.is_file()]
    assert any(p.is_relative_to(store) for p in written)  # the answer store was written
    for path in written:
        data = path.read_bytes()
        for name, secret in PHRASED.items():
            assert secret.encode() not in data, f"{name} in {path}"
