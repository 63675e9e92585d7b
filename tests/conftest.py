"""Shared fixtures. The real SmolLM2 target loads once per test session (seconds, from the cached conversion)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from outside import OutsideReads

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = OutsideReads()
sys.addaudithook(OUTSIDE)

# The suite runs under pytest-xdist, one worker per core (pyproject's addopts): each worker and every process it
# starts gets one OpenMP thread, since two workers with two threads each spin-wait on each other's cores. Run
# alone (`-n 0`), two threads on two cores, unless the machine is already busy: then one decodes several times faster.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_BUSY = os.getloadavg()[0] >= (os.cpu_count() or 1)
if _WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1 if _WORKER or _BUSY else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def reads_nothing_outside_the_clone():
    """Fails the test during which (its fixtures included) a file outside the clone and the system's own places
    was opened: tests/outside.py."""
    yield
    found = OUTSIDE.take()
    if found:
        pytest.fail(f"read outside the repository: {', '.join(sorted(set(found))[:5])}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def session_answer_store(tmp_path_factory):
    """Regenerated answers never go to (or come from) the user's store: module- and session-scoped fixtures, set
    up before any function-scoped one, use this store."""
    os.environ["DRAFTTRAIN_ANSWER_STORE"] = str(tmp_path_factory.mktemp("answers-session"))


@pytest.fixture(autouse=True)
def own_answer_store(tmp_path_factory, monkeypatch):
    """Each test its own answer store: regenerated answers are not shared between tests."""
    monkeypatch.setenv("DRAFTTRAIN_ANSWER_STORE", str(tmp_path_factory.mktemp("answers")))


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct target (fp32, CPU)."""
    from drafttrain.targets import load_target

    return load_target("smollm2-135m-instruct")


@pytest.fixture
def restore_threads():
    """The CLI's --threads sets torch's global thread count; put it back for the tests that follow."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (two spinning threads per worker on a 2-core machine are several times
    slower), the count put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def repo_data() -> Path:
    """The repository's own data: ``data/train/`` (training sources) and ``eval/`` (question suites), both with
    their provenance (SOURCES.md). Tests read nothing outside the clone."""
    return REPO


TEMPLATES = Path(__file__).parent / "templates"


def template_variant(base, template: str, specials: list[str], bos: str | None = None):
    """A tokenizer (SmolLM2's) with another real chat template; the template's control tokens added as single
    special tokens, as the real model's tokenizer has them."""
    import copy

    tok = copy.deepcopy(base)
    tok.add_tokens(specials, special_tokens=True)
    tok.chat_template = (TEMPLATES / template).read_text()
    if bos:
        tok.bos_token = bos
    return tok


def draft_vocab_file(folder: Path, keep, vocab: int) -> Path:
    """A draft_vocab.safetensors (d2t / t2d) keeping target ids ``keep`` of a ``vocab``-token vocabulary."""
    from safetensors.torch import save_file

    from drafttrain.data.vocab import build_mapping

    d2t, t2d = build_mapping(torch.as_tensor(sorted(keep)), vocab)
    path = folder / "draft_vocab.safetensors"
    save_file({"d2t": d2t, "t2d": t2d}, str(path))
    return path


def small_recipe(folder: Path, draft: dict, **sections) -> Path:
    """A recipe for an end-to-end test on the real target: 12 Alpaca conversations with their written answers, 9
    to train on, saved as ``folder/recipe.yaml`` (``sections`` add or replace recipe sections)."""
    import yaml

    recipe = {
        "output_dir": str(folder / "run"),
        "data": {"sources": [{"path": str(REPO / "data/train/alpaca_en_demo.json"), "max_samples": 12}],
                 "num_samples": 12, "validation_fraction": 0.25, "max_length": 96},
        "regenerate": {"enabled": False},
        "draft": draft,
        "wandb": {"mode": "disabled"},
        **sections,
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def killed_and_straight_losses(recipes: dict[str, Path], kill_at: int = 3) -> dict[str, dict[int, float]]:
    """Losses by step of `drafttrain train` on two prepared recipes, in subprocesses: "straight" runs to its end;
    "killed" is killed (SIGKILL) once its step-``kill_at`` checkpoint is written, then resumed with ``--resume``."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    losses = {}
    for name, recipe in recipes.items():
        command = [sys.executable, "-m", "drafttrain", "train", str(recipe)]
        run = Path(yaml.safe_load(recipe.read_text())["output_dir"])
        if name == "killed":
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            checkpoint = run / "checkpoints" / f"step-{kill_at:06d}"
            deadline = time.monotonic() + 240
            while not (checkpoint / "model.safetensors").is_file() and proc.poll() is None:
                assert time.monotonic() < deadline, f"no step-{kill_at} checkpoint in 4 minutes"
                time.sleep(0.05)
            proc.kill()
            assert proc.wait() == -9, "the run ended before it could be killed"
            command.append("--resume")
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = {r["step"]: r["loss"] for r in records if "loss" in r}
    return losses


@pytest.fixture(scope="session")
def folder_target(tmp_path_factory) -> Path:
    """A small random Llama saved as a model folder with SmolLM2's tokenizer: a target that loads in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.targets import load_tokenizer

    folder = tmp_path_factory.mktemp("target")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def moe_folder_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (4 experts, 2 a token; tests/families.py) saved as a model folder with SmolLM2's
    tokenizer."""
    from families import family_model

    from drafttrain.targets import load_tokenizer

    folder = tmp_path_factory.mktemp("moe-target")
    family_model("qwen3_moe").save_pretrained(folder)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return folder


def fitted_on_its_answer(target, config, steps: int, lr: float, prompt: list[int] | None = None):
    """A draft of ``config`` trained for ``steps`` on the target's own greedy answer to one prompt (by default a
    question about the moon): (the draft in eval mode, the prompt's ids, the answer, the losses). The serving tests
    then decode that prompt with it."""
    from drafttrain.decoding import plain_decode
    from drafttrain.drafts import build_drafter
    from drafttrain.targets import run_target

    if prompt is None:
        prompt = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": "List three facts about the moon."}], add_generation_prompt=True,
            return_dict=True)["input_ids"]
    greedy = plain_decode(target, prompt, 40).tokens
    torch.manual_seed(0)
    drafter = build_drafter(config, target).train()
    tokens = torch.tensor([prompt + greedy])
    mask = torch.zeros_like(tokens, dtype=torch.float32)
    mask[:, len(prompt):] = 1
    batch = {"input_ids": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        outputs = run_target(target, batch, drafter.needs())
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = drafter.training_step(batch, outputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return drafter.eval(), prompt, greedy, losses
