"""The second real target: Gemma 3 270M (built in, assembled from its chunk packages), whose layers attend over
a sliding window of 512 tokens on five layers of six. Speculative decoding past the window is the target's own
greedy output, token for token."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from drafttrain.data.chat import prompt_ids
from drafttrain.decoding import SpeculativeDecoder, plain_decode
from drafttrain.targets.cache import RECORDED_MARGIN


@pytest.fixture(scope="module")
def gemma():
    from drafttrain.targets import load_target

    return load_target("gemma3-270m")


@pytest.mark.slow
def test_gemma3_is_built_in_with_its_window_and_chat_format(gemma):
    config = gemma.model.config
    assert config.sliding_window == 512 and gemma.vocab_size == 262144
    assert config.layer_types.count("sliding_attention") == 15 and config.layer_types.count("full_attention") == 3
    text = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                               tokenize=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_gemma3_speculative_decoding_past_the_window_is_its_greedy_output(gemma):
    """A long-context suite prompt cut to about 700 tokens (past the 512-token window before the first drafted token),
    prompt lookup at depth 3: every refused draft rolls the sliding layers back past their window."""
    question = json.loads((REPO / "eval" / "long_context.jsonl").read_text().splitlines()[0])
    words = question["turns"][0][:2400]
    ids = prompt_ids(gemma.tokenizer, [{"role": "user", "content": words + "\n\nContinue this file."}])
    assert 600 < len(ids) < 900
    reference = plain_decode(gemma, ids, 48).tokens
    decoder = SpeculativeDecoder(gemma, "prompt_lookup", depth=3)
    out = decoder.generate(ids, 48)
    assert out.tokens == reference
    assert sum(out.stats.accepted_per_step) > 0 and any(out.stats.rejected_per_step)
    layers = decoder.cache.cache.layers
    # trimmed back to its window and the positions a rollback may still need, never the whole context
    held = {layer.keys.shape[-2] for layer in layers if layer.is_sliding}
    assert all(511 <= n <= 511 + RECORDED_MARGIN < decoder.cache.length for n in held), held
