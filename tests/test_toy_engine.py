"""A serving engine is one ``Engine`` plus the codecs that serve on it: a toy engine and a toy format of EAGLE-3
that it serves, defined here in the test file alone, make the model card print the toy engine's command, and make
``drafttrain bench`` export a checkpoint in that format for that engine, with the method the codec names in the
server's flags; an export in it is refused for vLLM, which does not serve it, naming the formats vLLM does."""

from __future__ import annotations

import pytest
import torch
from test_dflash import randomised
from test_export import tiny_target

from drafttrain import DrafttrainError
from drafttrain.config import BenchConfig, Eagle3Config
from drafttrain.drafts import build_drafter
from drafttrain.drafts.codecs import Codec, Exported, add_codec, remove_codec
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.engines.metrics import SpecCounters
from drafttrain.engines.server import ENGINES, Engine, Serving, register_engine, unregister_engine
from drafttrain.export import export_draft
from drafttrain.serving.bench import BenchInputs, check_inputs, resolve_draft


class ToyEngine(Engine):
    name, server_module, tested = "toyengine", "toyengine.serve", False
    requirement = "print('1.0')"
    steps_counter = "toy:steps_total"

    def server_args(self, target, port, spec, memory_fraction):
        args = ["--model", target, "--port", str(port)]
        if spec is not None:
            args += ["--draft", spec.model, "--method", self.serving_of(spec).method, "--k", str(spec.length)]
        return args

    def card_command(self, serving: Serving, target: str, depth: int) -> str:
        return f"```bash\ntoyserve {target} --draft THIS_REPO --method {serving.method} --k {depth}\n```"

    def read_counters(self, samples, steps) -> SpecCounters:
        return SpecCounters(steps, 0.0)


class ToyEngineFormat(Codec):
    """EAGLE-3's checkpoint as it is, served by the toy engine under the method name ``toy-eagle3``."""

    fmt = "toy_engine_format"
    engines = {"toyengine": "toy-eagle3"}

    def write(self, drafter) -> Exported:
        return Exported(drafter.checkpoint_config(export={"format": self.fmt}), drafter.state_tensors())

    def read(self, config, tensors):
        return config, tensors


@pytest.fixture
def toy_engine():
    register_engine(ToyEngine())
    add_codec(Eagle3Drafter, ToyEngineFormat())
    yield ENGINES["toyengine"]
    remove_codec(Eagle3Drafter, ToyEngineFormat.fmt)
    unregister_engine("toyengine")


def test_the_card_prints_the_toy_engines_command(toy_engine, tmp_path):
    target = tiny_target()
    torch.manual_seed(0)
    checkpoint = randomised(build_drafter(Eagle3Config(), target)).save_pretrained(tmp_path / "checkpoint")
    export = export_draft(checkpoint, ToyEngineFormat.fmt, tmp_path / "export", target)
    serve_it = (export / "README.md").read_text().split("## Serve it")[1].split("\n## ")[0]
    assert "toyserve" in serve_it and "--method toy-eagle3" in serve_it and "vllm serve" not in serve_it


def test_bench_exports_a_checkpoint_in_the_format_its_engine_serves(toy_engine, tmp_path):
    target = tiny_target()
    torch.manual_seed(0)
    checkpoint = randomised(build_drafter(Eagle3Config(), target)).save_pretrained(tmp_path / "checkpoint")
    draft = resolve_draft(str(checkpoint), toy_engine, target, tmp_path / "bench")
    assert draft.export.name.endswith(ToyEngineFormat.fmt)
    args = toy_engine.server_args("TARGET", 9000, draft.speculation(3), 0.5)
    assert args[args.index("--method") + 1] == "toy-eagle3" and args[args.index("--k") + 1] == "3"
    vllm = resolve_draft(str(checkpoint), ENGINES["vllm"], target, tmp_path / "bench-vllm")
    assert vllm.export.name.endswith("-vllm")  # vLLM still takes the kind's own first format


def test_an_export_in_the_toy_format_is_refused_for_vllm(toy_engine, tmp_path):
    target = tiny_target()
    torch.manual_seed(0)
    checkpoint = randomised(build_drafter(Eagle3Config(), target)).save_pretrained(tmp_path / "checkpoint")
    export = export_draft(checkpoint, ToyEngineFormat.fmt, tmp_path / "export", target)
    inputs = BenchInputs(drafts=[str(export)], target=None, python=__import__("sys").executable)
    with pytest.raises(DrafttrainError, match="toy_engine_format format, which vllm does not serve: export it again "
                                              "with --format vllm or speculators"):
        check_inputs(inputs, BenchConfig(port=18400), ENGINES["vllm"])
