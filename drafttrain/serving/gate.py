"""The consistency gate (``drafttrain train --gate``, ``eval.gate: true``): before a long run, check that what the
draft learns is what the engine will serve.

The target is served plainly and asked for its greedy continuation of one held-out prompt; a fresh draft of the
run's kind is overfit on that one row for a few steps; the result is exported through its kind's codec (the format the
engine evaluates checkpoints from: eval.engine_settings.format, else the first the engine reads) and served with the
draft; the engine's acceptance on the same row is compared with what the overfit head predicts (its teacher-forced
accuracy per position on the row, turned into a τ by ``simulated_tau``). An export that tells the engine something
else than what was trained (wrong aux layer ids, a norm, the vocabulary map, a format field) drafts other tokens, and
its acceptance falls far below the prediction: the run stops there, before the long run spends its GPU time, naming
both numbers. The gate's files (the overfit draft, its export, the servers' logs and ``gate.json``) stay in
``RUN/gate/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from drafttrain import DrafttrainError
from drafttrain.config import Recipe
from drafttrain.drafts.base import simulated_tau
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.continuation import ResolvedDraft, start_drafter
from drafttrain.engines.metrics import SpecCounters
from drafttrain.engines.server import Server, Speculation
from drafttrain.export.writer import export_draft
from drafttrain.runfolder import RunFolder, write_text_atomic
from drafttrain.serving.checkpoint_engine import EngineSetup, free_ports, served_format
from drafttrain.targets import Target
from drafttrain.targets.outputs import run_target
from drafttrain.userfiles import make_folder

log = logging.getLogger(__name__)

GATE_DIR = "gate"
REQUEST_TIMEOUT_S = 3600.0


@dataclasses.dataclass
class GateResult:
    predicted_tau: float  # from the overfit head's teacher-forced accuracy on the row
    engine_tau: float | None  # the engine's, serving the export on the same row
    accuracy_per_position: list[float]
    engine_acceptance_per_position: list[float]
    format: str
    answer_tokens: int
    outputs_equal: bool  # the engine's answer with the draft is the plain server's (lossless greedy decoding)
    tolerance: float
    folder: str

    @property
    def passed(self) -> bool:
        return self.engine_tau is not None and abs(self.engine_tau - self.predicted_tau) <= \
            self.tolerance * (self.predicted_tau - 1)


def check_gate(recipe: Recipe, whole: bool) -> None:
    """What the gate needs beyond the engine's settings (checked with them, before any work): the whole target in
    this process, which computes its row's target outputs."""
    if not whole:
        raise DrafttrainError("eval.gate computes its one row's target outputs with the whole target in this process, "
                              "and this run's processes do not hold it (ZeRO-3 partitions it, or capture engines run "
                              "its layers): run the gate where the target fits (ZeRO-2, capture.engine hf) first")


def run_gate(recipe: Recipe, draft: ResolvedDraft, target: Target) -> GateResult:
    """The gate (see the module docstring): returns its figures, or stops the run with a DrafttrainError."""
    run, settings = RunFolder.of(recipe.output_dir), recipe.eval.engine_settings
    folder = make_folder(run.root / GATE_DIR, "the consistency gate's files")
    setup = EngineSetup.of(recipe, target)
    prompt = setup.prompts.ids[0]
    log.info("consistency gate: the target's greedy answer to a held-out prompt, from the plain server")
    answer = _served(setup, None, folder / "plain.log", prompt, settings.gate_max_new_tokens)[0]
    drafter, accuracies, batch = overfit(draft, target, run, prompt, answer, settings.gate_steps,
                                         settings.gate_learning_rate)
    fmt = served_format(drafter, settings)
    if fmt is None:
        raise DrafttrainError(f"eval.gate: vLLM serves no format this {drafter.kind} draft is written in "
                              f"({', '.join(drafter.export_formats())}): there is nothing to check it against")
    checkpoint = drafter.save_pretrained(folder / "draft")
    export = export_draft(checkpoint, fmt, folder / f"export-{fmt}", target, overwrite=True)
    spec = Speculation("gate", setup.depth, codecs_of(type(drafter))[fmt].serving(drafter), str(export))
    served, counters = _served(setup, spec, folder / "draft.log", prompt, len(answer))
    predicted = simulated_tau(accuracies[:setup.depth])
    result = GateResult(predicted, counters.acceptance_length() if counters else None, accuracies[:setup.depth],
                        counters.per_position() if counters else [], fmt, len(answer), served == answer,
                        settings.gate_tolerance, str(folder))
    write_text_atomic(folder / "gate.json", json.dumps({**dataclasses.asdict(result), "passed": result.passed},
                                                        indent=1))
    _judge(result, export, folder, setup.depth)
    return result


def overfit(draft: ResolvedDraft, target: Target, run: RunFolder, prompt: list[int], answer: list[int], steps: int,
            learning_rate: float) -> tuple[Any, list[float], dict[str, torch.Tensor]]:
    """A fresh draft of the run's kind trained ``steps`` times on the one row prompt + answer (the answer trained);
    returns it in eval mode, its teacher-forced accuracy per draft position on the row, and the row."""
    drafter = start_drafter(draft, target, run, new_vocabulary=False).to(target.device).train()
    tokens = torch.tensor([prompt + answer], device=target.device)
    mask = torch.zeros_like(tokens)
    mask[:, len(prompt):] = 1
    batch = {"input_ids": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        outputs = run_target(target, batch, drafter.needs())
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=learning_rate)
    for _ in range(steps):
        loss = drafter.training_step(batch, outputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    with torch.no_grad():
        accuracies = drafter.training_step(batch, outputs).accuracies
    log.info("consistency gate: %d steps on one row of %d answer tokens, teacher-forced accuracy per position %s",
             steps, len(answer), ", ".join(f"{a:.2f}" for a in accuracies))
    return drafter, accuracies, batch


def _served(setup: EngineSetup, spec: Speculation | None, log_path: Path, prompt: list[int], max_tokens: int) \
        -> tuple[list[int], SpecCounters | None]:
    """The engine's greedy answer to ``prompt`` (token ids), served plainly or with ``spec``, and its speculative
    counters over that one request."""
    settings = setup.recipe.eval.engine_settings
    free_ports(settings)
    server = Server(setup.engine, setup.python, setup.target_dir, spec, settings.port + (spec is not None), log_path,
                    settings.memory_fraction, extra_args=["--dtype", setup.bench.dtype, *setup.bench.server_args])
    with server:
        server.wait_ready(settings.startup_timeout_s)
        before = setup.engine.counters(_get(server.base_url + "/metrics"))
        body = {"model": setup.target_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stop_token_ids": setup.prompts.stop_ids, "return_token_ids": True}
        answer = json.loads(_post(server, "/v1/completions", body))["choices"][0]["token_ids"]
        after = setup.engine.counters(_get(server.base_url + "/metrics"))
    return list(answer), (after - before if after is not None and before is not None else after)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(server: Server, path: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError) as err:
        server.check_alive("while the gate asked it")
        raise DrafttrainError(f"the {server.engine.name} server for {server.label} did not answer the gate's request "
                              f"({getattr(err, 'reason', err)})" + server.log_text()) from None


def _judge(result: GateResult, export: Path, folder: Path, depth: int) -> None:
    engine = "no τ (it counted no draft)" if result.engine_tau is None else f"τ {result.engine_tau:.2f} " \
        f"(acceptance per position {', '.join(f'{a:.2f}' for a in result.engine_acceptance_per_position)})"
    predicted = (f"τ {result.predicted_tau:.2f} (teacher-forced accuracy per position "
                 f"{', '.join(f'{a:.2f}' for a in result.accuracy_per_position)})")
    if result.predicted_tau - 1 < 0.5 * depth:
        raise DrafttrainError(f"the consistency gate is inconclusive: overfit on its one row the head predicts only "
                              f"{predicted}, too little to tell a broken export from a weak head; raise "
                              "eval.engine_settings.gate_steps or gate_learning_rate")
    if not result.passed:
        raise DrafttrainError(
            f"the consistency gate stopped the run: on its one row of {result.answer_tokens} tokens the overfit head "
            f"predicts {predicted}, but vLLM serving its {result.format} export measured {engine}, more than "
            f"{result.tolerance:.0%} of the predicted accepted tokens apart. The export does not draft what was "
            "trained: check what the format tells the engine (the aux hidden-state layer ids, a norm, the "
            f"vocabulary map d2t/t2d, a config field such as draft_vocab_size or the method). The export is {export}; "
            f"the servers' logs and gate.json are in {folder}")
    log.info("consistency gate passed: the head predicts %s on its row; vLLM serving its %s export measured %s%s",
             predicted, result.format, engine, "" if result.outputs_equal else
             " (its answer with the draft differs from plain serving's: a near-tie broken the other way)")
