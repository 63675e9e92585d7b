"""Linear layers with pre-packed oneDNN weights (drafttrain.cpu_linear): the same function as nn.Linear,
never stale, restored on exit, and lossless speculative decoding through them on the real target."""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain import DrafttrainError
from drafttrain.cpu_linear import ENV_VAR, PackedLinears, packing_available
from drafttrain.decoding import SpeculativeDecoder, build_proposer, plain_decode

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN (mkldnn)")


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 80, bias=False))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_a_packed_layer_computes_what_nn_linear_computes(rows):
    net = _layers()
    x = torch.randn(2, rows, 64)
    with torch.no_grad():
        expected = net(x)
        with PackedLinears(net) as packed:
            assert packed.count == 2
            got = net(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_bf16_layers_are_packed_only_where_onednn_can_and_compute_the_same():
    """oneDNN's bf16 reorder raises on CPUs without AVX-512 or AVX-NE-CONVERT (a bf16 target failed on this
    project's AVX2 machine): there the layers keep PyTorch's kernel; elsewhere they are packed. Same outputs."""
    net = _layers().to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = net(x)
        with PackedLinears(net) as packed:
            assert packed.count == (2 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 0)
            got = net(x)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@needs_onednn
def test_each_row_is_computed_independently_of_the_others():
    """A verification forward's row equals the same row computed alone (a plain step): bit for bit."""
    layer = torch.nn.Linear(576, 1536)
    x = torch.randn(9, 576)
    with torch.no_grad(), PackedLinears(layer):
        batched = layer(x)
        for i in range(9):
            assert torch.equal(layer(x[i:i + 1]), batched[i:i + 1])


@needs_onednn
def test_layers_are_restored_on_exit_even_after_an_error():
    net = _layers()
    with pytest.raises(RuntimeError, match="boom"):
        with PackedLinears(net):
            assert all("forward" in vars(layer) for layer in net)
            raise RuntimeError("boom")
    assert not any("forward" in vars(layer) for layer in net)


@needs_onednn
def test_a_weight_changed_inside_the_block_is_never_served_stale():
    net = _layers()
    x = torch.randn(4, 64)
    with torch.no_grad(), PackedLinears(net):
        stale = net[0](x)
        net[0].weight.mul_(2.0)  # an optimizer step does this, in place
        got = net[0](x)
        expected = torch.nn.functional.linear(x, net[0].weight, net[0].bias)
    # the changed layer runs PyTorch's own kernel on its new weight: bit for bit what F.linear gives (comparing
    # through the unchanged, still packed second layer would compare oneDNN's rounding with MKL's, which differ on
    # AMX CPUs)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, stale)


@needs_onednn
def test_autograd_gets_the_ordinary_layer():
    net = _layers()
    x = torch.randn(4, 64)
    with PackedLinears(net):
        out = net(x).sum()
        out.backward()
    assert net[0].weight.grad is not None and torch.isfinite(net[0].weight.grad).all()
    assert torch.equal(out.detach(), net(x).sum().detach())


@needs_onednn
def test_nested_blocks_pack_once_and_the_outer_one_restores():
    net = _layers()
    with PackedLinears(net) as outer:
        with PackedLinears(net) as inner:
            assert inner.count == 0  # already packed by the outer block
        assert all("forward" in vars(layer) for layer in net)
        assert outer.count == 2
    assert not any("forward" in vars(layer) for layer in net)


def test_the_default_kernel_packs_nothing_and_a_bad_choice_is_named(monkeypatch):
    net = _layers()
    with PackedLinears(net, mode="default") as kernels:
        assert kernels.count == 0 and not any("forward" in vars(layer) for layer in net)
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(DrafttrainError, match=ENV_VAR):
        PackedLinears(net)


@pytest.fixture(scope="module")
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def prompts_and_greedy(smollm2, repo_data, one_thread) -> list[tuple[list[int], list[int]]]:
    """Two MT-Bench first turns (a free-form answer, one that copies its prompt) and the target's greedy output
    for each with PyTorch's own kernel."""
    rows = [json.loads(line) for line in open(repo_data / "eval" / "mt_bench.jsonl")]
    out = []
    for row in (r for r in rows if r["question_id"] in (81, 90)):
        ids = list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                                         add_generation_prompt=True, tokenize=True)["input_ids"])
        out.append((ids, plain_decode(smollm2, ids, 40).tokens))
    return out


@needs_onednn
@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 4])
def test_speculative_greedy_through_packed_layers_is_the_targets_greedy(smollm2, prompts_and_greedy, depth):
    """Under packing (what the evaluator runs) the speculative output equals plain decoding's under packing, and
    both equal the target's greedy output with PyTorch's own kernel."""
    for ids, unpacked in prompts_and_greedy:
        with PackedLinears(smollm2.model) as kernels:
            assert kernels.count == 7 * smollm2.num_layers + 1  # q k v o gate up down per layer, and the lm_head
            plain = plain_decode(smollm2, ids, 40).tokens
            decoder = SpeculativeDecoder(smollm2, build_proposer("prompt_lookup", smollm2), depth=depth)
            out = decoder.generate(ids, 40)
        assert out.tokens == plain == unpacked
    assert not any("forward" in vars(m) for m in smollm2.model.modules())


@needs_onednn
@pytest.mark.slow
def test_evaluate_packs_every_side_and_says_so(smollm2, one_thread):
    from drafttrain.evaluation import evaluate

    kwargs = dict(depth=2, max_new_tokens=12, progress=False, warmup=False)
    report = evaluate(smollm2, "prompt_lookup", ["Repeat after me: the cat sat on the mat."], **kwargs)
    assert report.config["cpu_linear"] == {"mode": "packed", "packed_layers": 7 * smollm2.num_layers + 1}
    assert report.greedy_match == 1.0
    assert not any("forward" in vars(m) for m in smollm2.model.modules())
    plain = evaluate(smollm2, "prompt_lookup", ["Repeat after me: the cat sat on the mat."], cpu_linear="default",
                     **kwargs)
    assert plain.config["cpu_linear"] == {"mode": "default", "packed_layers": 0}
    assert plain.greedy_match == 1.0
    for field in ("new_tokens", "accepted_per_step"):  # the same drafts accepted: the same text
        assert plain.prompts[0][field] == report.prompts[0][field]
