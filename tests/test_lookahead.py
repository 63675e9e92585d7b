"""Lookahead decoding (drafttrain.decoding.lookahead): the target drafts for itself, and stays lossless.

* Its window is what the algorithm says: every side token's logits are those of a fresh forward, without a cache,
  over exactly the tokens it should see, and the n-grams the pool receives end in the target's own Jacobi outputs.
* Greedy output is the target's own, token for token: SmolLM2 (on a repetitive prompt its accepted tokens come from
  the pool's candidates), and tiny families of each attention cache kind (full, sliding, chunked, MLA), past refused
  candidates and rolled-back windows; recurrent and convolution targets refuse it in one line, as they refuse trees.
* At T=1 the sampled tokens follow the target's exact distribution (chi-squared), and two broken samplers fail the
  same test: one that keeps every candidate, one whose correction forgets the refused candidate.
* ``drafttrain eval``: its W, N and G are flags generated from the schema, checked before the target loads, and
  reported with the extra tokens a verification feeds.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest
import torch
from families import WINDOW, family_model, story_prompt
from test_decoding_sampling import BROKEN_THRESHOLD, P_THRESHOLD, _TinyTokenizer, chi2_pvalue

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.commands.eval import add_arguments
from drafttrain.config import DecodeSettings
from drafttrain.config.decode import LookaheadSettings
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode
from drafttrain.decoding.autodepth import choose_shape
from drafttrain.decoding.lookahead import LookaheadProposer
from drafttrain.targets import Target, load_tokenizer

NEW = 48
V = 6  # the sampling test's vocabulary
SAMPLING_PROMPT = [0, 3, 1, 4, 1, 5, 2, 0, 3, 5, 4]  # longer than the sliding window
SAMPLED = 5  # tokens generated per sample; tokens 4 and 5 are tested (the pool holds n-grams by then)
SAMPLES = 400


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread a test


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


class Recorded(LookaheadProposer):
    """The lookahead proposer, recording per step what it fed and what it was given back: the committed context
    (prompt and emitted tokens before the root), the root, the window's levels, the side tokens' logits, the
    candidates, the emitted tokens and the n-grams remembered."""

    def prefill(self, input_ids, hidden, next_token) -> None:
        super().prefill(input_ids, hidden, next_token)
        self.context, self.steps, self.remembered = input_ids[0].tolist(), [], []

    def propose(self, request):
        draft = super().propose(request)
        self.steps.append({"context": list(self.context), "root": self.root, "levels": [list(lv) for lv in self.levels],
                           "candidates": [list(n[: request.shape.depth]) for n in self.pool.get(self.root, [])],
                           "side": draft.side, "remembered": []})
        return draft

    def accept(self, tokens, hidden) -> None:
        emitted = tokens[0].tolist()
        self.steps[-1]["emitted"] = emitted
        super().accept(tokens, hidden)
        self.context += [self.steps[-1]["root"], *emitted[:-1]]

    def _remember(self, key, ngram) -> None:
        self.steps[-1]["remembered"].append((key, ngram))
        self.remembered.append((key, ngram))
        super()._remember(key, ngram)


def recorded(target: Target, **settings) -> Recorded:
    return Recorded(target, **settings)


# ------------------------------------------------------------------------------------------ the window is Jacobi's


def _seen_by(step: dict, level: int, column: int) -> list[int]:
    """The tokens the side token of ``level`` in ``column`` sees after the context, in order: the root, level 0's
    guesses before its column, and its own column's levels down to itself."""
    levels = step["levels"]
    if level == 0:
        return [step["root"], *levels[0][:column]]
    return [step["root"], *levels[0][:column], *(levels[lv][column] for lv in range(1, level + 1))]


def _slots(levels: list[list[int]]) -> list[tuple[int, int]]:
    return [(0, c) for c in range(1, len(levels[0]) + 1)] + [(lv, c) for lv in range(1, len(levels))
                                                             for c in range(len(levels[lv]))]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_window_token_sees_what_jacobi_iteration_runs_and_the_pool_gets_the_targets_outputs(family, tokenizer):
    """Every side token's logits equal a fresh, cache-free forward over the context and the tokens the algorithm says
    it sees, at their positions; in every step after the levels fill, each column's n-gram (its guesses down the
    levels, then the target's argmax after them) is what the pool receives."""
    target = Target(family, family_model(family, seed=1), tokenizer)
    proposer = recorded(target, lookahead_window=4, lookahead_ngram=4, lookahead_pool=3)
    prompt = story_prompt(tokenizer)
    out = SpeculativeDecoder(target, proposer, depth=3).generate(prompt, 16)
    assert out.tokens == plain_decode(target, prompt, 16).tokens
    steady = 0
    for step in proposer.steps:
        slots, logits = _slots(step["levels"]), step["side"].logits
        assert len(slots) == len(logits)
        outputs = {}
        for (level, column), row in zip(slots, logits):
            with torch.no_grad():
                fresh = target.model(torch.tensor([step["context"] + _seen_by(step, level, column)])).logits[0, -1]
            torch.testing.assert_close(row, fresh, atol=2e-4, rtol=1e-4)
            outputs[level, column] = int(fresh.argmax())
        levels = step["levels"]
        if len(levels) == proposer.ngram - 1:  # every level filled: each column gives the pool an n-gram
            steady += 1
            keys = [step["root"], *levels[0]]
            expected = [(key, tuple(levels[lv][c] for lv in range(1, len(levels))) + (outputs[len(levels) - 1, c],))
                        for c, key in enumerate(keys)]
            assert step["remembered"] == expected
        else:
            assert step["remembered"] == []
    assert steady >= 5


def test_the_window_moves_one_position_a_step_and_its_levels_fill_first(tokenizer):
    """W = 3, N = 4: level 0 starts with W + N - 3 prompt tokens and loses a column in each of the N - 2 steps that
    fill levels 1 and 2 (no n-gram before); then level 1 without its first column becomes level 0, and the
    outputs of the last level are its newest."""
    target = Target("llama", family_model("llama"), tokenizer)
    proposer = recorded(target, lookahead_window=3, lookahead_ngram=4, lookahead_pool=2)
    SpeculativeDecoder(target, proposer, depth=3).generate(story_prompt(tokenizer), 8)
    shapes = [[len(level) for level in step["levels"]] for step in proposer.steps]
    assert shapes[:4] == [[4], [3, 4], [2, 3, 3], [2, 3, 3]]
    filling, steady, after = proposer.steps[1:4]
    assert steady["levels"][:2] == [filling["levels"][0][1:], filling["levels"][1][1:]]
    filled = [int(row.argmax()) for row in filling["side"].logits[-4:]]  # level 1's outputs, its first one dropped
    assert steady["levels"][2] == filled[1:]
    newest = [int(row.argmax()) for row in steady["side"].logits[-3:]]
    assert after["levels"] == [steady["levels"][1][1:], steady["levels"][2], newest]


def test_the_pool_keeps_the_g_ngrams_seen_most_recently_per_first_token():
    proposer = LookaheadProposer(None, lookahead_window=2, lookahead_ngram=3, lookahead_pool=2)
    for ngram in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        proposer._remember(7, ngram)
    assert proposer.pool == {7: [(1, 2), (5, 6)]}  # (3, 4) was the least recently seen


def test_settings_are_checked_and_name_the_setting():
    assert LookaheadProposer.deepest(lookahead_ngram=5) == 4
    assert LookaheadProposer(None).max_depth == LookaheadSettings().lookahead_ngram - 1
    with pytest.raises(DrafttrainError, match="lookahead_ngram must be at least 3"):
        LookaheadProposer(None, lookahead_ngram=2)
    with pytest.raises(DrafttrainError, match="lookahead_pool must be positive"):
        build_proposer("lookahead", None, lookahead_pool=0)
    with pytest.raises(DrafttrainError, match="lookahead_size: unknown key"):
        build_proposer("lookahead", None, lookahead_size=3)


# ------------------------------------------------------------------------------------------------------- greedy


def _accepting(family: str, tokenizer, prompt: list[int]) -> tuple[Target, SpeculativeDecoder, object]:
    """The family's first seed on which lookahead both accepts candidates and refuses some (a random model's
    output differs in how often it repeats), with its run."""
    for seed in range(6):
        target = Target(f"{family}-{seed}", family_model(family, seed=seed), tokenizer)
        decoder = SpeculativeDecoder(target, build_proposer("lookahead", target, lookahead_window=5,
                                                            lookahead_ngram=3, lookahead_pool=5), depth=2)
        out = decoder.generate(prompt, NEW)
        if sum(out.stats.accepted_per_step) > 0 and sum(out.stats.rejected_per_step) >= 3:
            return target, decoder, out
    raise AssertionError(f"no seed of {family} has lookahead both accept and refuse candidates")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3", "mistral", "llama4", "deepseek_v3"])
def test_greedy_lookahead_is_the_targets_own_greedy_output_for_every_attention_cache(family, tokenizer):
    """Full attention, MoE, sliding windows (the prompt passes them), chunked attention, MLA: the side tokens
    rolled back with the refused candidates every step, the accepted ones kept."""
    prompt = story_prompt(tokenizer)
    assert len(prompt) > 3 * WINDOW
    target, decoder, out = _accepting(family, tokenizer, prompt)
    assert out.tokens == plain_decode(target, prompt, NEW).tokens
    assert decoder.cache.length == len(prompt) + NEW - 1
    assert all(fed > 1 + drafted for fed, drafted in zip(out.stats.fed_per_step, out.stats.drafted_per_step))


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_a_target_that_refuses_trees_refuses_lookahead_in_one_line(family, tokenizer):
    target = Target(family, family_model(family), tokenizer)
    with pytest.raises(DrafttrainError) as refused:
        SpeculativeDecoder(target, build_proposer("lookahead", target), depth=3)
    message = str(refused.value)
    assert "run the fed tokens in order" in message and "lookahead proposer's own tokens" in message
    assert "Use another proposer" in message and "\n" not in message


def test_depth_auto_is_refused_for_a_proposer_that_feeds_side_tokens(tokenizer):
    target = Target("llama", family_model("llama"), tokenizer)
    with pytest.raises(DrafttrainError, match="feeds tokens of its own beside it: give a depth"):
        choose_shape(target, build_proposer("lookahead", target), DecodeSettings.of(depth="auto"), ["hello"])


@pytest.mark.slow
def test_greedy_lookahead_on_smollm2_is_its_greedy_output_and_accepts_the_pools_candidates(smollm2, repo_data):
    """SmolLM2 on two MT-Bench questions and a repetitive prompt: the target's own greedy tokens; on the repetitive
    one, tokens are accepted, and each accepted run is a candidate the pool held, an n-gram of the target's own
    Jacobi outputs remembered in an earlier step."""
    rows = {json.loads(line)["question_id"]: json.loads(line) for line in open(repo_data / "eval" / "mt_bench.jsonl")}
    texts = [rows[81]["turns"][0], rows[90]["turns"][0],
             "Repeat this sentence five times: the quick brown fox jumps over the lazy dog."]
    for text in texts:
        prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       return_dict=True)["input_ids"]
        proposer = recorded(smollm2)  # the defaults: W 5, N 4, G 5
        out = SpeculativeDecoder(smollm2, proposer, depth=3).generate(prompt, NEW)
        assert out.tokens == plain_decode(smollm2, prompt, NEW).tokens
    accepted = [step for step in proposer.steps if len(step["emitted"]) > 1]
    assert sum(out.stats.accepted_per_step) >= 8 and len(accepted) >= 3
    for index, step in enumerate(proposer.steps):
        earlier = [(key, list(ngram)) for s in proposer.steps[:index] for key, ngram in s["remembered"]]
        for candidate in step["candidates"]:
            assert any(key == step["root"] and ngram[: len(candidate)] == candidate for key, ngram in earlier)
        run = step["emitted"][:-1]
        assert not run or any(c[: len(run)] == run for c in step["candidates"])


def test_a_shallower_depth_cuts_the_candidates(tokenizer):
    prompt = story_prompt(tokenizer)
    target, _, _ = _accepting("llama", tokenizer, prompt)
    proposer = recorded(target, lookahead_window=5, lookahead_ngram=4, lookahead_pool=5)
    out = SpeculativeDecoder(target, proposer, depth=1).generate(prompt, NEW)
    assert out.tokens == plain_decode(target, prompt, NEW).tokens
    assert max(out.stats.drafted_per_step) == 1 and any(step["candidates"] for step in proposer.steps)
    with pytest.raises(DrafttrainError, match="deeper than proposer 'lookahead' can fill"):
        SpeculativeDecoder(target, proposer, depth=4)


# ----------------------------------------------------------------------------------------------------- sampling


def exact_last_two(target: Target) -> np.ndarray:
    """P(token SAMPLED-1 = a, token SAMPLED = b) at T=1, by one batched forward over every continuation."""
    continuations = torch.tensor(list(itertools.product(range(V), repeat=SAMPLED - 1)))
    sequences = torch.cat([torch.tensor(SAMPLING_PROMPT).expand(len(continuations), -1), continuations], dim=1)
    with torch.no_grad():
        probs = torch.softmax(target.model(sequences).logits.double(), -1)
    start, rows = len(SAMPLING_PROMPT) - 1, torch.arange(len(sequences))
    path = torch.ones(len(sequences), dtype=torch.float64)
    for i in range(SAMPLED - 1):
        path *= probs[rows, start + i, continuations[:, i]]
    joint = torch.zeros(V, V, dtype=torch.float64)
    joint.index_add_(0, continuations[:, -1], path[:, None] * probs[:, start + SAMPLED - 1])
    return joint.numpy()


def lookahead_pvalue(family: str, samples: int = SAMPLES) -> tuple[float, int, int]:
    """The chi-squared p-value of the engine's last two sampled tokens against the exact joint, the candidate
    tokens accepted and the steps that refused one."""
    target = Target(family, family_model(family, seed=0, vocab_size=V), _TinyTokenizer())
    proposer = build_proposer("lookahead", target, lookahead_window=3, lookahead_ngram=3, lookahead_pool=3)
    decoder = SpeculativeDecoder(target, proposer, depth=2, temperature=1.0)
    counts, accepted, refused = np.zeros((V, V), dtype=np.int64), 0, 0
    for seed in range(samples):
        decoder.seed = seed
        out = decoder.generate(SAMPLING_PROMPT, SAMPLED)
        counts[out.tokens[-2], out.tokens[-1]] += 1
        accepted += sum(out.stats.accepted_per_step)
        refused += sum(out.stats.rejected_per_step)
    probs, flat = exact_last_two(target).ravel(), counts.ravel()
    rare = probs * flat.sum() < 5
    pvalue = chi2_pvalue(np.append(flat[~rare], flat[rare].sum()), np.append(probs[~rare], probs[rare].sum()))
    return pvalue, accepted, refused


SAMPLING_FAMILIES = ["qwen3_moe", "gemma3", "deepseek_v3"]  # full attention (MoE), sliding window, MLA


@pytest.mark.parametrize("family", SAMPLING_FAMILIES)
def test_sampled_lookahead_follows_the_target(family):
    pvalue, accepted, refused = lookahead_pvalue(family)
    assert accepted > SAMPLES // 4 and refused > SAMPLES // 4  # candidates both taken and refused
    assert pvalue > P_THRESHOLD


@pytest.mark.parametrize("family", SAMPLING_FAMILIES)
def test_a_sampler_that_keeps_every_candidate_fails(family, monkeypatch):
    import drafttrain.decoding.engine as engine

    def keep_chain(tokens, p, q, generator):
        k = tokens.shape[1]
        return torch.tensor(k), int(torch.multinomial(p[0, k], 1, generator=generator))

    def keep_first_branch(tokens, parents, p, q, generator):
        node, path = -1, []
        while node in parents:  # down the first child of each node
            node = parents.index(node)
            path.append(node)
        return path, int(torch.multinomial(p[node + 1], 1, generator=generator))

    monkeypatch.setattr(engine, "verify_chain", keep_chain)
    monkeypatch.setattr(engine, "verify_tree", keep_first_branch)
    assert lookahead_pvalue(family, samples=SAMPLES // 2)[0] < BROKEN_THRESHOLD


def test_a_correction_that_forgets_the_refused_candidate_fails(monkeypatch):
    """Subtler: after a candidate is refused the next token is drawn from p itself, not p without the candidate."""
    import drafttrain.decoding.verify as verify

    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert lookahead_pvalue("qwen3_moe", samples=2 * SAMPLES)[0] < BROKEN_THRESHOLD


# ---------------------------------------------------------------------------------------------- drafttrain eval


def _eval(tmp_path, target: str, *extra: str) -> int:
    return main(["eval", "--target", target, "--out", str(tmp_path / "out"), "--no-progress", *extra])


def test_the_flags_are_generated_from_the_schema():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {action.dest: action for action in parser._actions}
    for name, field in LookaheadSettings.model_fields.items():
        action = actions[name]
        assert "--" + name.replace("_", "-") in action.option_strings
        assert action.help.startswith(field.description) and f"default: {field.default}" in action.help


@pytest.mark.parametrize("flags, message", [
    (["--proposer", "prompt_lookup", "--lookahead-window", "7"],
     "--lookahead-window: settings of the lookahead proposer, which this run does not use"),
    (["--proposer", "lookahead", "--lookahead-ngram", "2"], "--lookahead-ngram must be at least 3"),
    (["--proposer", "prompt_lookup", "--compare", "lookahead", "--lookahead-pool", "0"],
     "--lookahead-pool must be positive"),
])
def test_a_bad_or_idle_flag_is_refused_before_the_target_loads(tmp_path, capsys, flags, message):
    assert _eval(tmp_path, "no-such-target", *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_eval_reports_lookahead_with_its_settings_and_the_tokens_it_feeds(tmp_path, capsys, folder_target,
                                                                         restore_threads):
    """The default depth is fitted to N - 1 (a compared lookahead's too); the settings are recorded for the method
    and the compared side; a verification feeds the window beside the candidates; greedy output is the baseline's."""
    code = _eval(tmp_path, str(folder_target), "--proposer", "lookahead", "--lookahead-ngram", "3",
                 "--lookahead-window", "4", "--compare", "prompt_lookup@3", "--compare", "again=lookahead",
                 "--suite", "gsm8k", "--num-prompts", "2", "--turns", "1", "--max-new-tokens", "12", "--threads", "1",
                 "--strict")
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    settings = {"lookahead_window": 4, "lookahead_ngram": 3, "lookahead_pool": 5}
    assert report["config"]["depth"] == 2 and report["config"]["proposer_kwargs"] == settings
    again = next(side for side in report["config"]["compare"] if side["label"] == "again")
    assert again["depth"] == 2 and again["proposer_settings"] == settings
    for record in report["prompts"]:  # the root, the window (its first step: level 0 alone), the candidates
        fed = record["fed_per_step"]
        assert fed[0] == 1 + (4 + 3 - 3) and all(width >= 1 + (4 - 1) + (3 - 2) * 4 for width in fed[1:])
    assert report["overall"]["tokens_per_verification"] > 5
    assert report["comparisons"]["prompt_lookup@3"]["tokens_per_verification"] <= 4
    assert report["comparisons"]["again"]["tau"] == report["overall"]["tau"]
    for line in report["comparisons"].values():
        assert line["greedy_match_vs_baseline"] == 1.0 and len(line["speed_vs_baseline_ci95"]) == 2
