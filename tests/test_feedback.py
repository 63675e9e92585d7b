"""The closed loop: an evaluation's accept/reject decisions become the next round's training signal.

The engine says, step by step, whether the token after the accepted draft replaced draft tokens the target refused;
the evaluator writes each answer as a request-log line with those positions; ``prepare`` keeps the answers as the
target's own and weighs the positions up in the loss mask, after checking that the re-tokenised answer is exactly
the logged token ids."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from datasets import load_from_disk

from drafttrain import DrafttrainError
from drafttrain.config import DataConfig, SourceConfig, parse_recipe
from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.data.tokenize import split_fingerprint, tokenize_conversation, trainable_count
from drafttrain.data.traffic import ANSWER_WEIGHTS, FEEDBACK_KEY, read_request_log, traffic_source
from drafttrain.decoding.engine import SpeculativeDecoder, plain_decode
from drafttrain.decoding.proposers import Proposer
from drafttrain.decoding.trees import Draft
from drafttrain.drafts.base import top1_hits
from drafttrain.drafts.dflash import dpace_weights
from drafttrain.evaluation import evaluate
from drafttrain.evaluation.feedback import rejected_positions
from drafttrain.targets import load_tokenizer
from drafttrain.training.prepare import _warn_lost_feedback as warn_lost_feedback
from drafttrain.training.prepare import prepare

QUESTIONS = ["List three fruits, then list the same three fruits again in the same order.",
             "Count from one to ten in words, separated by commas."]


class Corrupting(Proposer):
    """Drafts the target's own greedy continuation, wrong exactly at the answer indices ``wrong_at``.

    chain: the next ``depth`` tokens. tree: the next token as a leaf beside a wrong branch with a child, so a step
    whose draft is right still ends on a shorter path than the deepest one, with nothing refused after it."""

    name = "corrupting"

    def __init__(self, greedy: list[int], wrong_at: set[int], tree: bool = False):
        self.greedy, self.wrong_at, self.tree = greedy, wrong_at, tree

    def _token(self, i: int) -> int:
        return (self.greedy[i] + 1) % 49152 if i in self.wrong_at else self.greedy[i]

    def prefill(self, input_ids, hidden, next_token):
        self.at = 1  # the first token came from the prefill

    def propose(self, request):
        if self.at >= len(self.greedy):
            return Draft.empty()
        if self.tree:
            wrong = (self.greedy[self.at] + 2) % 49152
            return Draft(torch.tensor([[self._token(self.at), wrong, wrong]]), [-1, -1, 1])
        ids = [self._token(i) for i in range(self.at, min(self.at + request.shape.depth, len(self.greedy)))]
        return Draft.chain(torch.tensor([ids]))

    def accept(self, tokens, hidden):
        self.at += tokens.shape[1]


def _prompt(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": text}])])


@pytest.mark.slow
@pytest.mark.parametrize("tree, wrong_at", [(False, {2, 9, 20}), (True, {1, 4, 11})])
def test_the_engine_marks_exactly_the_steps_whose_draft_the_target_refused(smollm2, tree, wrong_at):
    prompt = _prompt(smollm2.tokenizer, QUESTIONS[1])
    greedy = plain_decode(smollm2, prompt, 30).tokens
    decoder = SpeculativeDecoder(smollm2, Corrupting(greedy, wrong_at, tree),
                                 **({"tree": [[0], [1], [1, 0]]} if tree else {"depth": 3}))
    out = decoder.generate(prompt, len(greedy))
    assert out.tokens == greedy
    stats = out.stats
    assert rejected_positions(stats.accepted_per_step, stats.rejected_per_step, len(out.tokens)) == sorted(wrong_at)
    if tree:  # right steps accept one token of a two-deep tree: shorter than drafted, yet nothing was refused
        assert sum(a < d for a, d in zip(stats.accepted_per_step, stats.drafted_per_step)) > len(wrong_at)


def test_rejected_positions_start_after_the_prefill_token_and_stop_at_the_cut():
    # steps: 2 accepted then a correction (index 3), 0 accepted and refused (index 4), all accepted (5, 6 + bonus 7)
    assert rejected_positions([2, 0, 2], [True, True, False], 8) == [3, 4]
    assert rejected_positions([2, 0, 2, 1], [True, True, False, True], 9) == [3, 4]  # index 9 was cut
    with pytest.raises(ValueError):
        rejected_positions([1, 2], [True], 5)


@pytest.mark.slow
def test_evaluation_feedback_becomes_weighted_training_rows_of_the_targets_own_answers(tmp_path, smollm2):
    path = tmp_path / "feedback.jsonl"
    report = evaluate(smollm2, "prompt_lookup", QUESTIONS, depth=4, max_new_tokens=48, progress=False,
                      warmup=False, feedback=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert report.config["feedback"]["answers"] == len(lines) == len(QUESTIONS)
    assert report.config["feedback"]["rejected_positions"] == sum(len(x[FEEDBACK_KEY]["rejected_at"]) for x in lines)
    stops = set(stop_token_ids(smollm2.tokenizer, smollm2.model.generation_config))
    for line, question in zip(lines, QUESTIONS):
        logged = line[FEEDBACK_KEY]
        assert line["request"]["messages"] == [{"role": "user", "content": question}]
        greedy = plain_decode(smollm2, _prompt(smollm2.tokenizer, question), 48, stop_token_ids=stops).tokens
        assert logged["answer_ids"] == greedy  # the target's own answer, lossless
        assert logged["complete"] == (greedy[-1] in stops)
    assert any(x[FEEDBACK_KEY]["rejected_at"] for x in lines)

    loaded, read = traffic_source(str(path), "request_log", "feedback", rejected_weight=5)
    assert not read.skipped and len(loaded.conversations) == len(lines)
    weighted = Counter()
    for conversation, line in zip(loaded.conversations, lines):
        assert conversation["answered_by"] == smollm2.name  # prepare keeps it instead of re-answering
        row = tokenize_conversation(smollm2.tokenizer, conversation, 512, weighted=weighted)
        logged, mask = line[FEEDBACK_KEY], row["loss_mask"]
        start = mask.index(next(w for w in mask if w))
        assert row["input_ids"][start: start + len(logged["answer_ids"])] == logged["answer_ids"]
        expected = [5 if i in logged["rejected_at"] else 1 for i in range(len(logged["answer_ids"]))]
        assert mask[start: start + len(expected)] == expected
        assert all(w == 0 for w in mask[start + len(expected):]) or logged["complete"]
        if not logged["complete"]:  # the template's end-of-turn after a cut answer is not trained
            assert trainable_count(mask) == len(logged["answer_ids"])
    assert weighted["answers weighted"] == len(lines)

    # prepare: the answers kept as the target's own (nothing re-answered), weighted in the train split only
    recipe = parse_recipe({
        "output_dir": str(tmp_path / "run"), "target": {"model": smollm2.name},
        "data": {"sources": [{"path": str(path), "format": "request_log", "rejected_weight": 5}],
                 "validation_fraction": 0.5, "max_length": 512}})
    result = prepare(recipe, target=smollm2, progress=False, show_summary=False)
    assert result.summary["regenerate"] is None  # nothing to re-answer (a summary of what was, otherwise)
    train, validation = (load_from_disk(str(tmp_path / "run" / "data" / split)) for split in ("train", "validation"))
    assert len(train) == len(validation) == 1
    assert result.summary["datasets"]["train"]["feedback"]["answers weighted"] == 1
    assert 5 in train[0]["loss_mask"] or not lines[int(train[0]["conversation_id"][-1])][FEEDBACK_KEY]["rejected_at"]
    assert set(validation[0]["loss_mask"]) <= {0, 1}


def _line(ids: list[int], rejected: list[int], complete: bool = True, text: str = "Paris.",
          question: str = "Capital of France?") -> str:
    feedback = {"answer_ids": ids, "rejected_at": rejected, "complete": complete}
    return json.dumps({"request": {"messages": [{"role": "user", "content": question}]},
                       "response": {"model": "smollm2-135m-instruct", "choices": [{
                           "message": {"role": "assistant", "content": text},
                           "finish_reason": "stop" if complete else "length"}]},
                       FEEDBACK_KEY: feedback})


def test_malformed_feedback_lines_are_named_and_a_cut_answer_is_kept_only_with_its_ids(tmp_path):
    path = tmp_path / "log.jsonl"
    cut_without_ids = json.loads(_line([1], [], complete=False, question="Capital of Spain?"))
    del cut_without_ids[FEEDBACK_KEY]
    path.write_text("\n".join([
        _line([], []), _line([5, "x"], []), _line([5, 6], [2]), _line([5, 6], [0]), _line([5, 6], [1], complete=None),
        _line([5, 6, 7], [1, 2], complete=False, text="A cut answer"), json.dumps(cut_without_ids)]) + "\n")
    read = read_request_log(path)
    reasons = [s.partition(": ")[2] for s in read.skipped]
    assert [r.split(":")[0] for r in reasons] == [FEEDBACK_KEY] * 5
    assert "answer_ids" in reasons[0] and "answer_ids" in reasons[1] and "rejected_at" in reasons[2]
    assert "rejected_at" in reasons[3] and "complete" in reasons[4]
    kept, plain = read.prompts
    assert kept.answer["content"] == "A cut answer" and kept.feedback["rejected_at"] == [1, 2]
    assert plain.answer is None  # a cut answer without its ids: the target answers it again


def test_an_answer_whose_tokens_differ_from_the_log_trains_unweighted_and_a_cut_one_is_skipped():
    tok = load_tokenizer("smollm2-135m-instruct")
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    conversation = {"id": "x", "messages": messages}
    plain = tokenize_conversation(tok, conversation, 256)
    answer = [t for t, w in zip(plain["input_ids"], plain["loss_mask"]) if w]
    good = dict(conversation, **{ANSWER_WEIGHTS: {"answer_ids": answer, "rejected_at": [1], "complete": True,
                                                  "rejected_weight": 7}})
    notes = Counter()
    row = tokenize_conversation(tok, good, 256, weighted=notes)
    assert sorted(set(row["loss_mask"])) == [0, 1, 7] and row["loss_mask"].count(7) == 1
    assert trainable_count(row["loss_mask"]) == trainable_count(plain["loss_mask"])
    wrong = dict(conversation, **{ANSWER_WEIGHTS: dict(good[ANSWER_WEIGHTS], answer_ids=[a + 1 for a in answer])})
    row = tokenize_conversation(tok, wrong, 256, weighted=notes)
    assert row["loss_mask"] == plain["loss_mask"]
    assert notes == {"answers weighted": 1, "rejected positions weighted": 1,
                     "answers whose text differs from the logged ids' (trained unweighted)": 1}
    # the target may emit a tokenisation its tokenizer would not produce: the row holds the ids it emitted
    letters = [tok.convert_tokens_to_ids(c) for c in "Paris"] + answer[-2:]  # P a r i s . <|im_end|>
    assert tok.decode(letters) == tok.decode(answer) and letters != answer
    spelt = dict(conversation, **{ANSWER_WEIGHTS: dict(good[ANSWER_WEIGHTS], answer_ids=letters, rejected_at=[4])})
    row = tokenize_conversation(tok, spelt, 256, weighted=notes)
    start = row["loss_mask"].index(1)
    assert row["input_ids"][start: start + len(letters)] == letters
    assert row["input_ids"][:start] == plain["input_ids"][:start]
    assert row["loss_mask"][start: start + len(letters)] == [1, 1, 1, 1, 7, 1, 1]
    assert notes["answers the target tokenised otherwise (its ids kept)"] == 1
    cut = dict(conversation, **{ANSWER_WEIGHTS: dict(wrong[ANSWER_WEIGHTS], complete=False)})
    skipped = Counter()
    assert tokenize_conversation(tok, cut, 256, skipped=skipped) is None and "cut at" in next(iter(skipped))
    # the split's fingerprint sees the weights: artifacts built from an unweighted split are not reused for it
    weighted = tokenize_conversation(tok, good, 256)
    assert split_fingerprint([weighted]) != split_fingerprint([plain])


def test_rejected_weight_is_for_request_logs_only(tmp_path):
    with pytest.raises(DrafttrainError, match="rejected_weight is for a request log"):
        parse_recipe({"output_dir": str(tmp_path), "target": {"model": "smollm2-135m-instruct"},
                      "data": {"sources": [{"path": "x.jsonl", "format": "sharegpt", "rejected_weight": 4}]}})
    assert DataConfig(sources=[SourceConfig(path="x.jsonl", format="request_log", rejected_weight=4)])


def test_weights_scale_the_loss_not_the_metrics_and_dpace_keeps_a_weight_on_its_own_slot():
    ids, wanted = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[3, 0, 5, 0]])
    assert top1_hits(ids, wanted, torch.tensor([[1, 4, 0, 1]])) == (1.0, 3.0)  # positions, not their weights
    sure, plain, weighted = torch.ones(3), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 4.0, 1.0])
    assert dpace_weights(sure, weighted, 0.5).tolist() == [3.0, 8.0, 1.0]
    assert dpace_weights(sure, plain, 0.5).tolist() == [3.0, 2.0, 1.0]


def test_feedback_that_the_target_must_answer_again_is_named_not_dropped_silently(caplog):
    rows = [{"id": "a", "answered_by": "HuggingFaceTB/SmolLM2-135M-Instruct", ANSWER_WEIGHTS: {"rejected_at": [1]}},
            {"id": "b", "answered_by": "other"}]
    with caplog.at_level("WARNING", logger="drafttrain.training.prepare"):
        warn_lost_feedback(rows, {"smollm2-135m-instruct"})
    (record,) = caplog.records
    assert "1 answers with evaluation feedback" in record.getMessage() and "HuggingFaceTB" in record.getMessage()
