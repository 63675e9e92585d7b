"""Response regeneration: answer slots, resume after an exception or a kill, settings guard, reproducible sampling,
greedy equality with HF generate (real SmolLM2), and the OpenAI-compatible client against a local server."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.data.chat import prompt_ids
from drafttrain.data.regenerate import (
    OutputPaths,
    SeededGumbelSampling,
    answer_slots,
    read_jsonl_resumable,
    regenerate_conversations,
    wire_messages,
)
from drafttrain.data.regenerate.hf import HFGenerator
from drafttrain.sampling import keep_top_p

TARGET = "smollm2-135m-instruct"
MAX_NEW = 6  # short answers: the machine is shared and every decode step counts

TOOL_CALL = {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    {"id": "one", "source": "t", "needs_response": True, "messages": [{"role": "user", "content": "What is 2+2?"}]},
    {"id": "two-turns", "source": "t", "needs_response": True,
     "messages": [{"role": "user", "content": "Name a fruit."}, {"role": "user", "content": "And a vegetable?"}]},
    {"id": "has-answer", "source": "t", "needs_response": False,
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."},
                  {"role": "assistant", "content": "ORIGINAL ANSWER"}]},
    {"id": "tool", "source": "t", "needs_response": False, "tools": json.dumps([{"name": "get_time", "parameters": {}}]),
     "messages": [{"role": "user", "content": "Time in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                  {"role": "tool", "content": "{\"time\": \"10:00\"}"},
                  {"role": "assistant", "content": "ORIGINAL TOOL ANSWER"}]},
]
OTHER = {"id": "five", "source": "t", "needs_response": True, "messages": [{"role": "user", "content": "Capital of Italy?"}]}




def hf_config(**kw) -> RegenerateConfig:
    return RegenerateConfig(**{"enabled": True, "max_new_tokens": MAX_NEW, "batch_size": 2, **kw})


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ no model needed


def test_answer_slots():
    assert answer_slots(CONVERSATIONS[0]["messages"]) == [(1, False)]
    assert answer_slots(CONVERSATIONS[1]["messages"]) == [(1, False), (2, False)]  # u, [a], u, [a]
    assert answer_slots(CONVERSATIONS[2]["messages"]) == [(2, True)]
    assert answer_slots(CONVERSATIONS[3]["messages"]) == [(3, True)]  # the tool call (index 1) is kept


def test_truncated_last_line_is_cut_and_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    assert [r["id"] for r in read_jsonl_resumable(path)] == ["a", "b"]
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'
    path.write_text('{"id": "a"}\n{"id": "b"')  # complete JSON but no newline: the write was cut, redo it
    assert [r["id"] for r in read_jsonl_resumable(path)] == ["a"]
    path.write_text('{"id": "a"}\n{"id": \n{"id": "c"}\n')
    with pytest.raises(DrafttrainError, match="line 2"):
        read_jsonl_resumable(path)


def test_settings_mismatch_is_an_error(tmp_path):
    out = tmp_path / "regenerated.jsonl"
    paths = OutputPaths.for_output(out)
    paths.settings.write_text(json.dumps({"target": TARGET, "backend": "hf", "temperature": 0.0, "top_p": 1.0,
                                          "max_new_tokens": MAX_NEW, "seed": 0}))
    out.write_text(json.dumps({"id": "one"}) + "\n")
    with pytest.raises(DrafttrainError, match=r"other settings \(.*temperature: 0.0 in the file, 0.7 now"):
        regenerate_conversations(CONVERSATIONS, hf_config(temperature=0.7), out, seed=0, target_name=TARGET)
    with pytest.raises(DrafttrainError, match="seed"):
        regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=1, target_name=TARGET)
    paths.settings.unlink()
    with pytest.raises(DrafttrainError, match="no settings file"):
        regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target_name=TARGET)


def test_gumbel_sampling_is_per_row_and_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    alone = SeededGumbelSampling([123], 1.0, 1.0)(None, logits.clone())
    batched = SeededGumbelSampling([7, 123, 9], 1.0, 1.0)(None, logits.repeat(3, 1))
    assert torch.equal(alone[0], batched[1])  # a row's draw does not depend on its batch-mates

    sampler = SeededGumbelSampling([0], 1.0, 1.0)
    draws = torch.stack([sampler(None, logits.clone()).argmax(-1) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(keep_top_p(probs.log(), 0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.8 >= 0.7 -> the crossing token stays


def test_wire_messages_link_tool_results_to_calls():
    wire = wire_messages(CONVERSATIONS[3]["messages"])
    call = wire[1]["tool_calls"][0]
    assert call["id"] == "call_0" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert wire[2] == {"role": "tool", "content": "{\"time\": \"10:00\"}", "tool_call_id": "call_0"}


# ------------------------------------------------------------------------------------------------ real SmolLM2


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    """An uninterrupted greedy run over all conversations: {id: row} and the output path."""
    out = tmp_path_factory.mktemp("reference") / "regenerated.jsonl"
    result = regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target=smollm2, progress=False)
    return {row["id"]: row for row in result.conversations}, out, result


@pytest.mark.slow
def test_regenerated_rows_have_the_expected_shape(reference):
    rows, out, result = reference
    assert list(rows) == [c["id"] for c in CONVERSATIONS] and result.regenerated == len(CONVERSATIONS)
    assert result.generated_tokens > 0 and result.tokens_per_second > 0
    for row in rows.values():
        assert row["regenerated_by"] == TARGET and row["finish_reason"] in ("stop", "length")
        assert row["needs_response"] is False and row["messages"][-1]["role"] == "assistant"
        assert all(m["content"].strip() for m in row["messages"] if m["role"] == "assistant" and not m.get("tool_calls"))
        assert any(m.get("truncated") for m in row["messages"]) == (row["finish_reason"] == "length")
    assert [m["role"] for m in rows["two-turns"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert rows["has-answer"]["messages"][2]["content"] != "ORIGINAL ANSWER"
    tool = rows["tool"]["messages"]
    assert tool[1:3] == CONVERSATIONS[3]["messages"][1:3]  # the call and its result are kept verbatim
    assert tool[3]["content"] != "ORIGINAL TOOL ANSWER"
    assert json.loads(OutputPaths.for_output(out).settings.read_text())["max_new_tokens"] == MAX_NEW


@pytest.mark.slow
def test_greedy_equals_hf_generate(reference, smollm2):
    rows, _, _ = reference
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(CONVERSATIONS[0]["messages"], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.inference_mode():
        out = smollm2.model.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.eos_token_id)
    expected = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert rows["one"]["messages"][-1]["content"] == expected


@pytest.mark.slow
def test_resume_after_an_interruption_equals_an_uninterrupted_run(reference, smollm2, tmp_path):
    rows, _, _ = reference
    out = tmp_path / "regenerated.jsonl"

    class Interrupt(Exception):
        pass

    def stop_after_one(row):  # mid-batch: the rerun batches the remaining rows differently
        raise Interrupt

    with pytest.raises(Interrupt):
        regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target=smollm2, progress=False,
                                 on_row=stop_after_one)
    assert len(read_rows(out)) == 1
    result = regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target=smollm2, progress=False)
    assert (result.reused, result.regenerated) == (1, len(CONVERSATIONS) - 1)
    written = read_rows(out)
    assert sorted(r["id"] for r in written) == sorted(rows)  # every id exactly once
    assert {r["id"]: r for r in written} == rows
    assert [r["id"] for r in result.conversations] == [c["id"] for c in CONVERSATIONS]  # input order


@pytest.mark.slow
def test_resume_after_a_kill_mid_write(reference, smollm2, tmp_path):
    rows, reference_out, _ = reference
    out = tmp_path / "regenerated.jsonl"
    for src in OutputPaths.for_output(reference_out).__dict__.values():
        if src.exists():
            shutil.copy(src, tmp_path / src.name)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 25])  # the last row's write was cut by a kill
    result = regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target=smollm2, progress=False)
    assert result.regenerated == 1
    written = read_rows(out)
    assert len(written) == len(CONVERSATIONS) and {r["id"]: r for r in written} == rows
    # A rerun with everything done generates nothing.
    again = regenerate_conversations(CONVERSATIONS, hf_config(), out, seed=0, target=smollm2, progress=False)
    assert again.regenerated == 0 and len(read_rows(out)) == len(CONVERSATIONS)


@pytest.mark.slow
def test_sampling_is_reproducible_and_independent_of_batching(smollm2, tmp_path):
    cfg = hf_config(temperature=0.9, top_p=0.95, max_new_tokens=4, batch_size=2)
    alone = regenerate_conversations(CONVERSATIONS[:1], cfg, tmp_path / "a.jsonl", seed=3, target=smollm2, progress=False)
    paired = regenerate_conversations([OTHER, CONVERSATIONS[0]], cfg, tmp_path / "b.jsonl", seed=3,
                                      target=smollm2, progress=False)
    assert alone.conversations[0]["messages"] == paired.conversations[1]["messages"]


def test_a_token_budget_puts_long_prompts_in_smaller_batches_with_the_same_answers(smollm2, tmp_path, monkeypatch):
    """regenerate.max_batch_tokens bounds rows x (widest prompt + max_new_tokens), the batch's KV cache: rows of
    growing length share a batch while they fit, the rest go alone, and the answers are those of one batch."""
    rows = [{"id": f"r{i}", "source": "t", "needs_response": True,
             "messages": [{"role": "user", "content": "Count the words: " + "word " * (4 + 30 * i)}]} for i in range(4)]
    lengths = [len(prompt_ids(smollm2.tokenizer, row["messages"])) for row in rows]
    budget = 2 * (lengths[1] + MAX_NEW)  # the first two fit together, the longer two only alone
    batches, real = [], HFGenerator.generate

    def counted(self, prompts, seeds):  # the real generate, its batches recorded
        batches.append([len(p) for p in prompts])
        return real(self, prompts, seeds)

    monkeypatch.setattr(HFGenerator, "generate", counted)
    one = regenerate_conversations(rows, hf_config(batch_size=4, reuse_answers=False), tmp_path / "a.jsonl",
                                   seed=0, target=smollm2, progress=False)
    assert batches == [lengths]
    batches.clear()
    split = regenerate_conversations(rows, hf_config(batch_size=4, max_batch_tokens=budget, reuse_answers=False),
                                     tmp_path / "b.jsonl", seed=0, target=smollm2, progress=False)
    assert batches == [lengths[:2], lengths[2:3], lengths[3:]]
    assert [r["messages"] for r in split.conversations] == [r["messages"] for r in one.conversations]


# ------------------------------------------------------------------------------------------------ OpenAI backend


class ChatServer(ThreadingHTTPServer):
    """A minimal OpenAI-compatible /v1/chat/completions on 127.0.0.1 that echoes the last user turn."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ChatHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
            self.server.auth.append(self.headers.get("Authorization"))
        if self.path != "/v1/chat/completions":
            return self._send(404, {"error": "not found"})
        if body["model"] == "forbidden":
            return self._send(401, {"error": "bad key"})
        last = next(m["content"] for m in reversed(body["messages"]) if m["role"] in ("user", "tool"))
        text = "" if "EMPTY" in last else f"echo: {last}"
        finish = "length" if "LONG" in last else "stop"
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish}], "usage": {"completion_tokens": 3}})

    def _send(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def chat_server():
    server = ChatServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def openai_config(url: str, **kw) -> RegenerateConfig:
    return RegenerateConfig(**{"enabled": True, "backend": "openai", "base_url": url, "served_model": "served-smol",
                               "api_key_env": "DRAFTTRAIN_TEST_KEY", "max_new_tokens": 16, "batch_size": 3, **kw})


OPENAI_CONVERSATIONS = CONVERSATIONS[:4] + [
    {"id": "empty", "source": "t", "needs_response": False,
     "messages": [{"role": "user", "content": "EMPTY please"}, {"role": "assistant", "content": "kept original"}]},
    {"id": "long", "source": "t", "needs_response": True, "messages": [{"role": "user", "content": "LONG story"}]},
]


def test_openai_backend_against_a_local_server(chat_server, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTTRAIN_TEST_KEY", "sk-test-secret")
    out = tmp_path / "regenerated.jsonl"
    with caplog.at_level(logging.DEBUG):
        result = regenerate_conversations(OPENAI_CONVERSATIONS, openai_config(chat_server.url + "/v1"), out, seed=0,
                                          target_name=TARGET, progress=False)
    rows = {r["id"]: r for r in result.conversations}
    assert set(rows) == {"one", "two-turns", "has-answer", "tool", "long"} and result.dropped == {"empty_answer": 1}
    assert rows["one"]["messages"][-1]["content"] == "echo: What is 2+2?"
    assert rows["one"]["regenerated_by"] == "served-smol" and rows["long"]["finish_reason"] == "length"
    assert [m["content"] for m in rows["two-turns"]["messages"]] == [
        "Name a fruit.", "echo: Name a fruit.", "And a vegetable?", "echo: And a vegetable?"]
    assert rows["tool"]["messages"][3]["content"] == "echo: {\"time\": \"10:00\"}"

    # The second turn was asked with the regenerated first answer in its history.
    second = next(r for r in chat_server.requests if [m["content"] for m in r["messages"]][-1] == "And a vegetable?")
    assert second["messages"][1] == {"role": "assistant", "content": "echo: Name a fruit."}
    first = chat_server.requests[0]
    assert first["model"] == "served-smol" and first["max_tokens"] == 16 and first["temperature"] == 0.0
    tool_request = next(r for r in chat_server.requests if r.get("tools"))
    assert tool_request["tools"][0]["function"]["name"] == "get_time"
    assert set(chat_server.auth) == {"Bearer sk-test-secret"}
    # The key is sent, never written or logged.
    assert "sk-test-secret" not in caplog.text
    assert not any("sk-test-secret" in p.read_text() for p in tmp_path.iterdir())

    # Rerun: nothing left to ask (the dropped row is remembered too).
    asked = len(chat_server.requests)
    again = regenerate_conversations(OPENAI_CONVERSATIONS, openai_config(chat_server.url), out, seed=0,
                                     target_name=TARGET, progress=False)
    assert len(chat_server.requests) == asked and again.reused == len(OPENAI_CONVERSATIONS)
    assert again.dropped == {"empty_answer": 1} and len(again.conversations) == 5


def test_openai_keep_original_on_empty_and_http_errors(chat_server, tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTTRAIN_TEST_KEY", raising=False)
    cfg = openai_config(chat_server.url, keep_original_on_empty=True)
    result = regenerate_conversations(OPENAI_CONVERSATIONS[4:5], cfg, tmp_path / "keep.jsonl", seed=0,
                                      target_name=TARGET, progress=False)
    row = result.conversations[0]
    assert row["messages"][1]["content"] == "kept original" and row["kept_original_answers"] == 1
    assert chat_server.auth == [None]  # no key in the environment: no Authorization header

    with pytest.raises(DrafttrainError, match="HTTP 401"):
        regenerate_conversations(CONVERSATIONS[:1], openai_config(chat_server.url, served_model="forbidden"),
                                 tmp_path / "err.jsonl", seed=0, target_name=TARGET, progress=False)


def test_answers_are_reused_across_runs_of_the_same_target_and_settings(reference, smollm2, tmp_path):
    """A second run (another output, another recipe) gets the same answers from the answer store, generating
    nothing; other settings, or reuse switched off, generate again."""
    rows, _, _ = reference
    first = regenerate_conversations(CONVERSATIONS, hf_config(), tmp_path / "first.jsonl", seed=0, target=smollm2,
                                     progress=False)
    assert (first.from_store, first.regenerated) == (0, len(CONVERSATIONS))  # this test's store starts empty
    again = regenerate_conversations(CONVERSATIONS, hf_config(), tmp_path / "other.jsonl", seed=0, target=smollm2,
                                     progress=False)
    assert (again.from_store, again.regenerated, again.generated_tokens) == (len(CONVERSATIONS), 0, 0)
    assert [c["messages"] for c in again.conversations] == [rows[c["id"]]["messages"] for c in CONVERSATIONS]
    longer = regenerate_conversations(CONVERSATIONS[:1], hf_config(max_new_tokens=MAX_NEW + 1), tmp_path / "l.jsonl",
                                      seed=0, target=smollm2, progress=False)
    assert (longer.from_store, longer.regenerated) == (0, 1)
    off = regenerate_conversations(CONVERSATIONS[:1], hf_config(reuse_answers=False), tmp_path / "off.jsonl", seed=0,
                                   target=smollm2, progress=False)
    assert (off.from_store, off.regenerated) == (0, 1)


def test_answers_a_run_already_had_join_the_store(reference, smollm2, tmp_path):
    """A run folder written before the store existed (or with the store off) still fills it when resumed."""
    rows, _, _ = reference
    first = regenerate_conversations(CONVERSATIONS, hf_config(reuse_answers=False), tmp_path / "old.jsonl", seed=0,
                                     target=smollm2, progress=False)
    assert first.regenerated == len(CONVERSATIONS)
    regenerate_conversations(CONVERSATIONS, hf_config(), tmp_path / "old.jsonl", seed=0, target=smollm2,
                             progress=False)  # resumed: nothing to generate, but the store learns its answers
    other = regenerate_conversations(CONVERSATIONS, hf_config(), tmp_path / "new.jsonl", seed=0, target=smollm2,
                                     progress=False)
    assert (other.from_store, other.regenerated) == (len(CONVERSATIONS), 0)
