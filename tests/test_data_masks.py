"""Assistant-only loss masks on three real chat templates (SmolLM2 ChatML, Llama-3.1-Instruct, Qwen2.5-Instruct),
packing and length-grouped batching."""

from __future__ import annotations

import copy
import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import template_variant

from drafttrain import DrafttrainError
from drafttrain.data.chat import TOOLS_SYSTEM_HEADER, TemplateSupport, template_support
from drafttrain.data.conversations import load_conversations
from drafttrain.data.tokenize import assistant_spans, length_grouped_order, pack, pack_plan, tokenize_conversation

TEMPLATES = Path(__file__).parent / "templates"
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]


@pytest.fixture(scope="module")
def smol():
    from drafttrain.targets import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")




@pytest.fixture(scope="module")
def llama(smol):
    return template_variant(smol, "llama3.1_instruct.jinja", LLAMA_SPECIALS, bos="<|begin_of_text|>")


@pytest.fixture(scope="module")
def qwen(smol):
    return template_variant(smol, "qwen2.5_instruct.jinja", ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])


@pytest.fixture(scope="module")
def glaive(repo_data):
    return load_conversations(str(repo_data / "data/train/glaive_toolcall_demo.json")).conversations


def conv(*turns: tuple[str, str], **extra) -> dict:
    return {"id": "t:0", "source": "t", "needs_response": False,
            "messages": [{"role": r, "content": c} for r, c in turns], **extra}


def trainable_runs(tok, row: dict) -> list[str]:
    """Decoded maximal runs of trainable tokens."""
    runs, current = [], []
    for token, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


MULTI_TURN = conv(
    ("system", "You are terse."),
    ("user", "What is 2+2?"),
    ("assistant", "4."),
    ("user", "And 3+3? Explain briefly."),
    ("assistant", "6, because 3 doubled is 6.\nDone."),
)

# (fixture name, end-of-turn marker, content as the template renders it)
TEMPLATE_CASES = [
    ("smol", "<|im_end|>", lambda s: s),
    ("llama", "<|eot_id|>", str.strip),  # Llama-3 trims message content
    ("qwen", "<|im_end|>", lambda s: s),
]


@pytest.mark.parametrize("name,eot,rendered", TEMPLATE_CASES)
def test_multi_turn_mask_is_exactly_the_assistant_outputs(request, name, eot, rendered):
    tok = request.getfixturevalue(name)
    row = tokenize_conversation(tok, MULTI_TURN, max_length=1024)
    assert len(row["input_ids"]) == len(row["loss_mask"])
    expected = [rendered(m["content"]) + eot for m in MULTI_TURN["messages"] if m["role"] == "assistant"]
    assert trainable_runs(tok, row) == expected
    # The full text round-trips, and no system/user text or header is trainable.
    text, _ = assistant_spans(tok, MULTI_TURN)
    assert tok.decode(row["input_ids"]) == text
    trained = "".join(trainable_runs(tok, row))
    for m in MULTI_TURN["messages"]:
        if m["role"] != "assistant":
            assert m["content"] not in trained
    assert "assistant" not in trained


def test_chatml_exact_ids_and_mask(smol):
    """Independent construction: prompt tokens (0), answer + <|im_end|> (1), trailing newline (0)."""
    c = conv(("user", "Name a colour."), ("assistant", "Blue is a colour."))
    row = tokenize_conversation(smol, c, max_length=256)
    prompt = (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
              "<|im_start|>assistant\n")
    enc = lambda s: smol(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids_prompt, ids_answer, ids_tail = enc(prompt), enc("Blue is a colour.<|im_end|>"), enc("\n")
    assert row["input_ids"] == ids_prompt + ids_answer + ids_tail
    assert row["loss_mask"] == [0] * len(ids_prompt) + [1] * len(ids_answer) + [0] * len(ids_tail)
    assert smol.convert_ids_to_tokens(ids_answer[-1]) == "<|im_end|>"


@pytest.mark.parametrize("name,injected", [("smol", SMOL_SYSTEM), ("qwen", QWEN_SYSTEM),
                                           ("llama", "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024")])
def test_injected_system_text_is_present_but_not_trainable(request, name, injected):
    tok = request.getfixturevalue(name)
    c = conv(("user", "Hi"), ("assistant", "Hello there!"))
    row = tokenize_conversation(tok, c, max_length=256)
    assert injected in tok.decode(row["input_ids"])
    assert len(trainable_runs(tok, row)) == 1 and injected not in trainable_runs(tok, row)[0]


def test_special_tokens_are_single_tokens_in_template_variants(llama, qwen):
    row = tokenize_conversation(llama, conv(("user", "Hi"), ("assistant", "Yo")), max_length=128)
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert row["input_ids"][-1] == eot and row["loss_mask"][-1] == 1
    assert llama.convert_ids_to_tokens(row["input_ids"][0]) == "<|begin_of_text|>" and row["loss_mask"][0] == 0
    row = tokenize_conversation(qwen, conv(("user", "Hi"), ("assistant", "Yo")), max_length=128)
    assert qwen.convert_ids_to_tokens(row["input_ids"][-2:]) == ["<|im_end|>", "Ċ"] and row["loss_mask"][-2:] == [1, 0]


def test_reasoning_template_that_rewrites_history(smol):
    """Qwen3 renders an empty think block on the last answer but not on earlier ones (not prefix-stable): the earlier
    answer is found by content, the last one is trained with the think block the model really generates."""
    tok = template_variant(smol, "qwen3.jinja", ["<think>", "</think>"])
    row = tokenize_conversation(tok, MULTI_TURN, max_length=1024)
    assert trainable_runs(tok, row) == ["4.<|im_end|>", "<think>\n\n</think>\n\n6, because 3 doubled is 6.\nDone.<|im_end|>"]
    assert tok.decode(row["input_ids"]).count("<think>") == 1


def test_template_tool_support_is_probed(smol, llama, qwen):
    assert template_support(smol) == template_support(smol)
    assert (template_support(smol).tool_calls, template_support(smol).tools) == (False, False)
    assert (template_support(llama).tool_calls, template_support(llama).tools) == (True, True)
    assert (template_support(qwen).tool_calls, template_support(qwen).tools) == (True, True)


GLAIVE_CALL_ARGS = {"ingredients": ["chicken", "bell peppers", "rice"]}


@pytest.mark.parametrize(
    "name,call_text,eot",
    [
        ("smol", json.dumps({"name": "search_recipes", "arguments": GLAIVE_CALL_ARGS}), "<|im_end|>"),
        ("llama", '{"name": "search_recipes", "parameters": ' + json.dumps(GLAIVE_CALL_ARGS) + "}", "<|eot_id|>"),
        ("qwen", '<tool_call>\n{"name": "search_recipes", "arguments": ' + json.dumps(GLAIVE_CALL_ARGS)
         + "}\n</tool_call>", "<|im_end|>"),
    ],
)
def test_glaive_tool_turns(request, glaive, name, call_text, eot):
    """The real glaive example: calls are trained in the model's own syntax; tool results and definitions are not."""
    tok = request.getfixturevalue(name)
    c = glaive[0]
    row = tokenize_conversation(tok, c, max_length=4096)
    answers = [m["content"] for m in c["messages"] if m["role"] == "assistant" and m["content"]]
    runs = trainable_runs(tok, row)
    assert runs == [answers[0] + eot, call_text + eot] + [a + eot for a in answers[1:]]
    full = tok.decode(row["input_ids"])
    assert "Search for recipes based on ingredients" in full  # tool definitions reach the prompt in every template
    tool_result = next(m["content"] for m in c["messages"] if m["role"] == "tool")
    assert not any("Chicken and Rice Casserole\", \"ingredients" in r for r in runs)
    assert tool_result[:40] in full or json.dumps(tool_result)[:40] in full


def test_tools_go_to_the_system_prompt_for_templates_without_tool_support(smol, glaive):
    text, _ = assistant_spans(smol, glaive[0])
    assert text.startswith(f"<|im_start|>system\n{TOOLS_SYSTEM_HEADER}\n" + '{"name": "search_recipes"')
    assert SMOL_SYSTEM not in text  # the default prompt is replaced, as for any explicit system message


@pytest.mark.parametrize("name", ["smol", "llama", "qwen"])
def test_every_glaive_conversation_tokenises(request, glaive, name):
    tok = request.getfixturevalue(name)
    skipped = Counter()
    rows = [tokenize_conversation(tok, c, max_length=8192, skipped=skipped) for c in glaive[:120]]
    assert skipped == Counter() and all(r and sum(r["loss_mask"]) > 0 for r in rows)


def test_truncation_keeps_the_head_and_cuts_the_mask(smol):
    c = conv(("user", "Q1"), ("assistant", "First answer."), ("user", "Q2"),
             ("assistant", "Second answer is a much longer sentence with many words in it."))
    full = tokenize_conversation(smol, c, max_length=1024)
    cut = len(full["input_ids"]) - 6
    row = tokenize_conversation(smol, c, max_length=cut)
    assert row["input_ids"] == full["input_ids"][:cut] and row["loss_mask"] == full["loss_mask"][:cut]
    assert trainable_runs(smol, row)[0] == "First answer.<|im_end|>"
    assert "Second answer is a much longer" in trainable_runs(smol, row)[1]


def test_truncation_without_trainable_tokens_is_a_counted_skip(smol):
    c = conv(("user", "A long question " * 20), ("assistant", "Short."))
    skipped = Counter()
    assert tokenize_conversation(smol, c, max_length=30, skipped=skipped) is None
    assert skipped == Counter({"no trainable tokens after truncation": 1})


def test_overlength_drop_is_a_counted_skip(smol):
    c = conv(("user", "Hello"), ("assistant", "A fairly long answer " * 10))
    skipped = Counter()
    assert tokenize_conversation(smol, c, max_length=20, overlength="drop", skipped=skipped) is None
    assert skipped == Counter({"longer than max_length (overlength=drop)": 1})
    assert tokenize_conversation(smol, c, max_length=2048, overlength="drop") is not None


def test_prompt_only_and_trailing_user_turns(smol, repo_data):
    skipped = Counter()
    mt = load_conversations(str(repo_data / "eval/mt_bench.jsonl")).conversations[0]
    assert tokenize_conversation(smol, mt, max_length=512, skipped=skipped) is None
    assert skipped == Counter({"prompt-only (needs_response): no assistant turn to train on": 1})
    # A trailing user turn has no answer to learn: it is not rendered at all.
    row = tokenize_conversation(smol, conv(("user", "Hi"), ("assistant", "Hey."), ("user", "UNANSWERED")), 256)
    assert "UNANSWERED" not in smol.decode(row["input_ids"])


def test_missing_chat_template_is_an_error_naming_the_fix(smol):
    tok = copy.deepcopy(smol)
    tok.chat_template = None
    with pytest.raises(DrafttrainError, match=r"no chat template.*target\.chat_template"):
        tokenize_conversation(tok, conv(("user", "Hi"), ("assistant", "Hey")), max_length=64)


@pytest.fixture(scope="module")
def gemma(smol):
    return template_variant(smol, "gemma2_it.jinja", ["<bos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>")


def test_strict_template_without_system_or_tool_support(gemma, glaive):
    """Gemma-2 refuses system turns and non-alternating roles and knows no tools: system text and tool definitions
    open the first user turn, tool results become user turns, calls are JSON text; all of it still trains."""
    assert template_support(gemma) == TemplateSupport(tool_calls=False, tools=False, tool_role=False, system_role=False)
    row = tokenize_conversation(gemma, MULTI_TURN, max_length=512)
    assert trainable_runs(gemma, row) == ["4.<end_of_turn>", "6, because 3 doubled is 6.\nDone.<end_of_turn>"]
    assert "<start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>" in gemma.decode(row["input_ids"])
    row = tokenize_conversation(gemma, glaive[0], max_length=4096)
    call = json.dumps({"name": "search_recipes", "arguments": GLAIVE_CALL_ARGS})
    assert trainable_runs(gemma, row)[1] == call + "<end_of_turn>"
    text = gemma.decode(row["input_ids"])
    assert text.startswith(f"<bos><start_of_turn>user\n{TOOLS_SYSTEM_HEADER}\n" + '{"name": "search_recipes"')
    assert "<start_of_turn>user\n{\"recipes\": [{\"name\": \"Chicken and Bell Pepper Stir Fry\"" in text


def test_template_that_rejects_a_conversation_is_a_counted_skip(gemma):
    skipped = Counter()
    two_users = conv(("user", "Hi"), ("user", "Anyone?"), ("assistant", "Yes."))
    assert tokenize_conversation(gemma, two_users, max_length=256, skipped=skipped) is None
    assert skipped == Counter({"chat template rejected the conversation: Conversation roles must alternate "
                               "user/assistant/user/assistant/...": 1})


def test_token_straddling_header_and_content_is_trainable(smol):
    tok = copy.deepcopy(smol)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    row = tokenize_conversation(tok, conv(("user", "Hi"), ("assistant", "Hey")), max_length=64)
    # No end-of-turn marker in this template (the newline is separator). The header's trailing space and the content
    # share one BPE token (" Hey"): a token overlapping the content is trainable, since it is the one that carries it.
    assert trainable_runs(tok, row) == [" Hey"]


# ----------------------------------------------------------------------------------------------- packing / grouping


@pytest.fixture(scope="module")
def gsm_rows(smol, repo_data):
    convs = load_conversations(str(repo_data / "data/train/gsm8k_train.jsonl")).conversations[:40]
    rows = [tokenize_conversation(smol, c, max_length=512) for c in convs]
    return [dict(r, conversation_id=c["id"]) for r, c in zip(rows, convs)]


def test_pack_keeps_every_document_and_restarts_positions(gsm_rows):
    packed = pack(gsm_rows, max_length=512)
    total = sum(len(r["input_ids"]) for r in gsm_rows)
    assert all(len(p["input_ids"]) <= 512 for p in packed)
    assert len(packed) <= math.ceil(total / 512) + 1  # best-fit decreasing leaves little room unused
    by_id = {r["conversation_id"]: r for r in gsm_rows}
    seen = []
    for p in packed:
        assert len(p["input_ids"]) == len(p["loss_mask"]) == len(p["position_ids"]) == p["num_tokens"]
        assert p["num_trainable"] == sum(p["loss_mask"])
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [len(p["input_ids"])]
        assert len(starts) - 1 == len(p["conversation_ids"])
        for (a, b), cid in zip(zip(starts, starts[1:]), p["conversation_ids"]):
            assert p["input_ids"][a:b] == by_id[cid]["input_ids"] and p["loss_mask"][a:b] == by_id[cid]["loss_mask"]
            assert p["position_ids"][a:b] == list(range(b - a))
        seen += p["conversation_ids"]
    assert sorted(seen) == sorted(by_id)
    assert pack(gsm_rows, max_length=512) == packed  # deterministic


def test_pack_plan_rejects_overlong_rows():
    assert pack_plan([5, 3, 2, 4], 7) == [[0, 3], [1, 2]] or pack_plan([5, 3, 2, 4], 7) == [[0, 2], [1, 3]]
    assert sorted(i for b in pack_plan([5, 3, 2, 4], 7) for i in b) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="more than max_length"):
        pack_plan([3, 9], 8)


def test_length_grouped_order_is_a_seeded_permutation_that_cuts_padding():
    rng = random.Random(0)
    lengths = [rng.randint(10, 2000) for _ in range(1000)]
    order = length_grouped_order(lengths, batch_size=8, seed=1)
    assert sorted(order) == list(range(1000))
    assert order == length_grouped_order(lengths, batch_size=8, seed=1)
    assert order != length_grouped_order(lengths, batch_size=8, seed=2)

    def padding(idx):
        batches = [idx[i:i + 8] for i in range(0, len(idx), 8)]
        return sum(max(lengths[j] for j in b) * len(b) - sum(lengths[j] for j in b) for b in batches)

    shuffled = list(range(1000))
    random.Random(3).shuffle(shuffled)
    assert padding(order) < 0.1 * padding(shuffled)
    # Batches are not sorted globally: the first few batches are not all the longest ones.
    firsts = [max(lengths[j] for j in order[i:i + 8]) for i in range(0, 80, 8)]
    assert firsts != sorted(firsts, reverse=True)
    # 3 rows left over: their short batch goes last, so the batches still start at multiples of 8
    lengths += [5, 3000, 7]
    order = length_grouped_order(lengths, batch_size=8, seed=1)
    assert sorted(order) == list(range(1003))
    assert padding(order[:1000]) < 0.1 * padding(shuffled)  # a short batch mid-way would misalign those after it
