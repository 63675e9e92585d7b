"""The user's own files that cannot be read and places that cannot be written: each is one line naming the path
and the cause (drafttrain.userfiles), never a traceback from a library, and nothing already written is lost."""

from __future__ import annotations

import errno
import sys

from conftest import REPO, small_recipe

from drafttrain.commands import main

BINARY = b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary, not text"


def refusal(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # above it at most a library's progress bar
    assert last.startswith(f"drafttrain {argv[0]}: error: "), err
    return last


def test_a_binary_request_log_is_named_before_any_work(tmp_path, capsys):
    log = tmp_path / "requests.jsonl"
    log.write_bytes(BINARY)
    recipe = small_recipe(tmp_path, {"kind": "eagle3"},
                          data={"sources": [{"path": str(log), "format": "request_log"}], "validation_fraction": 0.0})
    err = refusal(capsys, "prepare", str(recipe), "--no-progress")
    assert f"request log {log} is not UTF-8 text" in err


def test_a_binary_questions_file_is_named(tmp_path, capsys, folder_target):
    questions = tmp_path / "questions.jsonl"
    questions.write_bytes(BINARY)
    err = refusal(capsys, "eval", "--target", str(folder_target), "--proposer", "prompt_lookup", "--questions",
                  str(questions), "--out", str(tmp_path / "out"), "--no-progress")
    assert f"question file {questions} is not UTF-8 text" in err


def test_a_truncated_lora_adapter_of_the_target_is_named_in_eval_and_prepare(tmp_path, capsys, folder_target):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder_target)),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(str(adapter))
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    spec = f"{folder_target}+{adapter}"
    err = refusal(capsys, "eval", "--target", spec, "--proposer", "prompt_lookup", "--out", str(tmp_path / "o"),
                  "--no-progress")
    assert f"target.adapter {adapter}: its weights cannot be read" in err
    recipe = small_recipe(tmp_path, {"kind": "eagle3"}, target={"model": str(folder_target), "adapter": str(adapter)},
                          regenerate={"enabled": True, "max_new_tokens": 4})
    assert f"target.adapter {adapter}: its weights cannot be read" in refusal(capsys, "prepare", str(recipe),
                                                                                "--no-progress")


def test_a_missing_adapter_folder_is_named_not_taken_for_a_hub_id(tmp_path, capsys, folder_target):
    for adapter, why in ((tmp_path / "nowhere", "does not exist"), (folder_target, "has no adapter_config.json")):
        err = refusal(capsys, "eval", "--target", f"{folder_target}+{adapter}", "--proposer", "prompt_lookup",
                      "--out", str(tmp_path / "o"), "--no-progress")
        assert f"the adapter folder {adapter} {why}" in err and "Hub" not in err


def test_prepare_with_a_target_that_is_nowhere_names_it(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here: the Hub answers at once
    recipe = small_recipe(tmp_path, {"kind": "eagle3"}, target={"model": "no-org/no-such-model"})
    err = refusal(capsys, "prepare", str(recipe), "--no-progress")
    assert "could not load target 'no-org/no-such-model'" in err and "built-in target" in err


def test_prepare_under_a_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    recipe = small_recipe(tmp_path, {"kind": "eagle3"}, output_dir=str(blocker / "run"))
    err = refusal(capsys, "prepare", str(recipe), "--no-progress")
    assert f"cannot write the run folder (output_dir) {blocker / 'run'}" in err
    assert "a part of the path is a file, not a folder" in err or "a file is there" in err


def test_prepare_into_a_read_only_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """As root every folder is writable, so the file system's answer is the one a read-only mount gives."""
    from pathlib import Path

    real_touch = Path.touch

    def read_only(self, *args, **kwargs):
        if self.name == ".drafttrain-write-check":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_touch(self, *args, **kwargs)

    monkeypatch.setattr(Path, "touch", read_only)
    recipe = small_recipe(tmp_path, {"kind": "eagle3"})
    err = refusal(capsys, "prepare", str(recipe), "--no-progress")
    assert f"cannot write the run folder (output_dir) {tmp_path / 'run'}" in err and "read-only" in err


def test_report_when_the_plots_folder_is_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "plots").write_text("a file")
    err = refusal(capsys, "report", str(run))
    assert f"cannot write the plots folder {run / 'plots'}: a file is there, not a folder" in err


def test_bench_with_a_vllm_python_that_is_no_program(tmp_path, capsys):
    fake = tmp_path / "python"
    fake.write_bytes(BINARY)
    fake.chmod(0o755)
    err = refusal(capsys, "bench", "ngram", "--target", "smollm2-135m-instruct", "--vllm-python", str(fake),
                  "--out", str(tmp_path / "out"))
    assert f"--vllm-python {fake} cannot be run: it is not a program this machine can run" in err


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_last_checkpoint_stays(tmp_path, capsys, monkeypatch,
                                                                                    folder_target):
    """torch.save on a full disk fails with "unexpected pos"; the message says so plainly, names the checkpoint,
    and that the previous one is whole and --resume continues from it."""
    import torch

    recipe = small_recipe(tmp_path, {"kind": "eagle3", "ttt_steps": 1}, target={"model": str(folder_target)},
                          training={"max_steps": 4, "save_every": 2}, eval={"every_checkpoint": False})
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(f)
        if (tmp_path / "run" / "checkpoints" / "step-000002").is_dir():  # the second checkpoint finds no room
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4352")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    err = refusal(capsys, "train", str(recipe))
    assert "cannot write the checkpoint" in err and "step-000004" in err and "no space left on the device" in err
    assert "step-000002, is intact: make room and continue with --resume" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", str(recipe), "--resume"]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step-000004" / "model.safetensors").is_file()
    assert sys.modules["drafttrain.userfiles"].disk_full(RuntimeError("unexpected pos 1 vs 2"))
    assert (REPO / "drafttrain" / "userfiles.py").is_file()
