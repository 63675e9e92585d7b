"""Nothing lost: drafttrain deletes only what it made, one process works in a run folder at a time, every writer
turns a full disk, a file-size limit or a read-only folder into one line and leaves nothing half-written as if
whole, and a secret pasted into a recipe leaves the machine redacted.

How the disk failures are made: a full disk by monkeypatching the write call to raise what it raises on a full
disk (OSError ENOSPC; safetensors' SafetensorError worded as it words ENOSPC on a full tmpfs); a file-size limit for
real, with RLIMIT_FSIZE in a subprocess (SIGXFSZ ignored, so the write fails with EFBIG); a read-only run folder by
monkeypatching the os-level opens to raise EROFS (the tests run as root, whom chmod does not stop)."""

from __future__ import annotations

import ast
import builtins
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, small_recipe

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.runfolder import LOCK_FILE, RUN_MARKER, RunFolder, RunLock

SUBPROCESS_ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TOKENS = {"regenerate": {"enabled": False, "api_key_env": "hf_" + "Ab3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3h"},
          "wandb": {"mode": "disabled", "project": "sk-proj-" + "x7Y9z1A3b5C7d9E1f3G5h7J9"}}


def refusal(capsys, *argv) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith(f"drafttrain {argv[0]}: error: "), err
    return last


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its sha256: what must be there, unchanged, after a refusal."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tiny_recipe(folder: Path, target: Path, **sections) -> Path:
    """The real-data recipe of conftest on the small folder target: prepares and trains in seconds."""
    training = {"max_steps": 2, "save_every": 1, "keep_last": 3, **sections.pop("training", {})}
    return small_recipe(folder, {"kind": "eagle3", "ttt_steps": 1}, target={"model": str(target)},
                        training=training, eval={"every_checkpoint": False}, **sections)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, folder_target) -> Path:
    """A prepared and trained run (two checkpoints): ``trained / "run"``, its recipe ``trained / "recipe.yaml"``."""
    folder = tmp_path_factory.mktemp("trained")
    recipe = tiny_recipe(folder, folder_target)
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    return folder


@pytest.fixture
def run_copy(trained, tmp_path, folder_target) -> Path:
    """A copy of the trained run in this test's folder, with its recipe pointing at the copy."""
    shutil.copytree(trained / "run", tmp_path / "run")
    tiny_recipe(tmp_path, folder_target)
    return tmp_path


# --------------------------------------------------------------------------------------------- deletes only its own


DELETERS = {"rmtree", "unlink", "rmdir", "removedirs"}  # by any name; `remove` only as os.remove (lists have one)


def delete_calls(path: Path) -> list[str]:
    """Every call of a deleting function in a module, outside drafttrain.userfiles.remove."""
    tree = ast.parse(path.read_text())
    allowed = set()
    if path.name == "userfiles.py":
        remove = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "remove")
        allowed = {id(n) for n in ast.walk(remove)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in allowed:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        os_remove = isinstance(func, ast.Attribute) and name == "remove" and \
            isinstance(func.value, ast.Name) and func.value.id == "os"
        if name in DELETERS or os_remove:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(func)}")
    return found


def test_one_function_deletes_anything_in_the_package():
    found = [call for path in sorted((REPO / "drafttrain").rglob("*.py")) for call in delete_calls(path)]
    assert found == [], "delete through drafttrain.userfiles.remove, which checks drafttrain made it:\n" + \
        "\n".join(found)


def test_prepare_into_a_copy_of_the_source_tree_is_refused_and_its_data_kept(tmp_path, capsys, monkeypatch):
    """`drafttrain prepare RECIPE output_dir=.` from a clone: the data it reads is in data/train, where prepare
    writes its split. Refused before any work, naming the source; every file as it was, no marker written."""
    clone = tmp_path / "clone"
    for name in ("alpaca_en_demo.json", "glaive_toolcall_demo.json"):
        (clone / "data" / "train").mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "data" / "train" / name, clone / "data" / "train" / name)
    shutil.copy(REPO / "README.md", clone / "README.md")
    (clone / ".git").mkdir()
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    recipe = small_recipe(tmp_path, {"kind": "eagle3"}, data={
        "sources": [{"path": "data/train/alpaca_en_demo.json", "max_samples": 8},
                    {"path": "data/train/glaive_toolcall_demo.json", "max_samples": 4}],
        "num_samples": 12, "validation_fraction": 0.25, "max_length": 96})
    before = snapshot(clone)
    monkeypatch.chdir(clone)
    err = refusal(capsys, "prepare", recipe, "output_dir=.", "--no-progress")
    assert f"output_dir {clone} holds data.sources.0.path ({clone / 'data/train/alpaca_en_demo.json'}), which " \
           "this recipe reads and prepare would replace" in err and "choose a new or empty folder" in err
    assert snapshot(clone) == before and not (clone / RUN_MARKER).exists()


def test_prepare_into_the_home_folder_is_refused_and_the_thesis_kept(tmp_path, capsys, monkeypatch):
    from drafttrain.runfolder import cache_root

    home = tmp_path / "home"
    (home / "data" / "train").mkdir(parents=True)
    (home / "data" / "train" / "thesis.txt").write_text("four years of work\n")
    (home / "notes.md").write_text("mine\n")
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(cache_root()))  # models stay where they are; only HOME moves
    monkeypatch.setenv("HOME", str(home))
    recipe = small_recipe(tmp_path, {"kind": "eagle3"}, output_dir="~")
    before = snapshot(home)
    err = refusal(capsys, "prepare", recipe, "--no-progress")
    assert f"output_dir {home} is your home folder" in err
    assert snapshot(home) == before and not (home / RUN_MARKER).exists()


@pytest.mark.parametrize("place, why", [
    ("root", "holds your home folder"),
    ("source tree", "is a source tree (it holds .git)"),
    ("other files", "holds files drafttrain did not write (a.txt, b.txt)"),
])
def test_a_folder_drafttrain_did_not_make_is_refused_by_name(tmp_path, place, why):
    folder = {"root": Path("/"), "source tree": tmp_path / "src", "other files": tmp_path / "other"}[place]
    if place == "source tree":
        (folder / ".git").mkdir(parents=True)
        (folder / "setup.py").write_text("x")
    if place == "other files":
        folder.mkdir()
        for name in ("a.txt", "b.txt"):
            (folder / name).write_text("x")
    with pytest.raises(DrafttrainError, match=re.escape(f"output_dir {folder} {why}")):
        RunFolder.of(folder).claim()
    assert not (folder / RUN_MARKER).exists()


def test_a_new_or_empty_folder_is_made_a_run_and_an_earlier_run_is_taken_up(run_copy, tmp_path, caplog):
    for fresh in (tmp_path / "new" / "run", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        RunFolder.of(fresh).claim()
        assert (fresh / RUN_MARKER).is_file()
    earlier = run_copy / "run"
    (earlier / RUN_MARKER).unlink()  # a run folder written before drafttrain marked them
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(run_copy / "recipe.yaml"), "--resume", "--max-steps", "3"]) == 0
    assert f"taking up {earlier}, a run folder an earlier drafttrain wrote" in caplog.text
    assert (earlier / RUN_MARKER).is_file() and (earlier / "checkpoints" / "step-000003").is_dir()


def test_remove_refuses_what_drafttrain_did_not_make(tmp_path, monkeypatch):
    from drafttrain.userfiles import remove

    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "thesis.txt").write_text("x")
    with pytest.raises(DrafttrainError, match=re.escape(f"will not delete {mine / 'data'} (a split): {mine} is not a "
                                                        "folder drafttrain made; nothing was removed")):
        RunFolder(mine).remove(mine / "data", "a split")
    with pytest.raises(DrafttrainError, match="not scratch that drafttrain names"):
        remove(mine / "data", "scratch")
    monkeypatch.chdir(mine / "data")
    (mine / RUN_MARKER).write_text("{}")
    with pytest.raises(DrafttrainError, match="it is or holds the current folder"):
        RunFolder(mine).remove(mine / "data", "a split")
    monkeypatch.setenv("HOME", str(mine))
    with pytest.raises(DrafttrainError, match="it is or holds your home folder"):
        remove(mine, "an export", inside=mine, made=lambda folder: True)
    assert (mine / "data" / "thesis.txt").read_text() == "x"


def test_export_over_the_run_or_its_checkpoints_is_refused_and_the_run_kept(run_copy, capsys):
    """`export RUN --out RUN --overwrite` deleted the run; `--out RUN/checkpoints` every checkpoint. Both refused
    (before the target loads), the run byte for byte as it was."""
    run = run_copy / "run"
    before = snapshot(run)
    draft = run / "checkpoints" / "step-000002"  # the newest: what `export RUN` exports
    for out, why in ((run, f"it is or holds the draft being exported ({draft})"),
                     (run / "checkpoints", f"it is or holds the draft being exported ({draft})"),
                     (draft, f"it is or holds the draft being exported ({draft})"),
                     (run / "checkpoints" / "step-000001", f"it is in the run being exported ({run}), not in its "
                                                           "exports/ folder")):
        err = refusal(capsys, "export", run, "--format", "vllm", "--out", out, "--overwrite")
        assert f"--out {out} cannot be replaced (--overwrite): {why}" in err, err
    other = run_copy / "other"
    shutil.copytree(run, other)  # another run folder: refused as one
    err = refusal(capsys, "export", run, "--format", "vllm", "--out", other, "--overwrite")
    assert "it is a run folder" in err
    assert snapshot(run) == before and not list(run_copy.glob("*.partial"))


def test_export_overwrite_replaces_an_earlier_export_and_nothing_else(run_copy, capsys):
    run, out = run_copy / "run", run_copy / "export"
    assert main(["export", str(run), "--format", "vllm", "--out", str(out)]) == 0
    assert main(["export", str(run), "--format", "vllm", "--out", str(out), "--overwrite"]) == 0
    assert (out / "manifest.json").is_file() and not out.with_name("export.partial").exists()
    album = run_copy / "album"
    album.mkdir()
    (album / "photo.jpg").write_bytes(b"\xff\xd8 a photo")
    err = refusal(capsys, "export", run, "--format", "vllm", "--out", album, "--overwrite")
    assert "it is not a folder `drafttrain export` or `drafttrain import` wrote" in err
    assert (album / "photo.jpg").read_bytes() == b"\xff\xd8 a photo"


def test_push_replaces_its_own_export_in_the_run(run_copy, capsys):
    """push's default export folder, <run>/exports/<format>, is replaced on every push (a dry run here)."""
    for _ in range(2):
        assert main(["push", str(run_copy / "run"), "--repo", "me/draft", "--format", "vllm", "--dry-run"]) == 0
    assert (run_copy / "run" / "exports" / "vllm" / "manifest.json").is_file()


# --------------------------------------------------------------------------------------------- one run at a time


HOLDER = """
import sys, time
from drafttrain.runfolder import RunLock
with RunLock(sys.argv[1], "drafttrain watch"):
    print("held", flush=True)
    time.sleep(600)
"""


def hold_lock(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], env=SUBPROCESS_ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_and_a_killed_holders_lock_taken_over(tmp_path, caplog):
    folder = tmp_path / "run"
    RunFolder.of(folder).claim()
    holder = hold_lock(folder)
    try:
        with pytest.raises(DrafttrainError, match=re.escape(f"{folder} is in use by another drafttrain process (pid "
                                                            f"{holder.pid}, `drafttrain watch`, started ")
                           + r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\): wait for it to end"):
            RunLock(folder, "drafttrain train").__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING), RunLock(folder, "drafttrain train"):
        record = json.loads((folder / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["command"] == "drafttrain train"
        with RunLock(folder, "drafttrain export"):  # the same process again (quickstart's prepare in its train)
            pass
    assert f"taking over the lock of {folder} left by pid {holder.pid}" in caplog.text and "killed?" in caplog.text
    assert (folder / LOCK_FILE).read_text() == ""  # released: no record left


@pytest.fixture
def not_rank_zero(monkeypatch):
    monkeypatch.setenv("RANK", "1")


def test_the_other_ranks_of_a_launch_take_no_lock(tmp_path, not_rank_zero):
    folder = tmp_path / "run"
    RunFolder.of(folder).claim()
    holder = hold_lock(folder)  # rank 0 of the launch
    try:
        with RunLock(folder, "drafttrain train"):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_two_trains_on_one_run_folder_one_is_refused_and_a_killed_ones_lock_is_taken_over(run_copy, capsys, caplog):
    """Two `drafttrain train` on one folder: the second is refused naming the first's pid and start time. The first
    is then killed (kill -9); the next train takes its lock over, saying so."""
    recipe = run_copy / "recipe.yaml"
    shutil.rmtree(run_copy / "run" / "checkpoints")  # a fresh run in a prepared folder
    command = [sys.executable, "-m", "drafttrain", "train", str(recipe), "training.max_steps=100000",
               "training.save_every=100000"]
    first = subprocess.Popen(command, cwd=REPO, env=SUBPROCESS_ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    lock = run_copy / "run" / LOCK_FILE
    deadline = time.monotonic() + 240
    while not (lock.is_file() and lock.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, "the first train never took the lock"
        time.sleep(0.1)
    started = json.loads(lock.read_text())["started"]
    second = subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=240)
    assert first.poll() is None, "the first train ended before the second asked"
    first.kill()
    first.wait()
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"is in use by another drafttrain process (pid {first.pid}, `drafttrain train`, started {started})" in \
        second.stderr
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(recipe), "--resume", "--max-steps", "1"]) == 0
    assert f"left by pid {first.pid}, `drafttrain train`, started {started}, which ended without releasing it" in \
        caplog.text


# --------------------------------------------------------------------------------------------- full disks and limits


def safetensors_full_disk(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_writing_the_draft_vocabulary_is_one_line(tmp_path, capsys, monkeypatch, folder_target):
    import drafttrain.data.vocab

    recipe = tiny_recipe(tmp_path, folder_target, draft_vocab={"enabled": True, "size": 256})
    monkeypatch.setattr(drafttrain.data.vocab, "save_file", safetensors_full_disk)
    err = refusal(capsys, "prepare", recipe, "--no-progress")
    assert f"cannot write the draft vocabulary {tmp_path / 'run' / 'draft_vocab.safetensors'}: no space left on the " \
           "device; what an earlier prepare left whole is kept" in err
    assert not (tmp_path / "run" / "draft_vocab.safetensors").exists()


def test_a_full_disk_at_a_later_checkpoint_is_one_line_and_the_earlier_one_resumes(run_copy, capsys, monkeypatch):
    import drafttrain.drafts.base

    real = drafttrain.drafts.base.save_file

    def full_at_step_four(tensors, path, *args, **kwargs):
        if "step-000004" in path:
            safetensors_full_disk()
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(drafttrain.drafts.base, "save_file", full_at_step_four)
    recipe = run_copy / "recipe.yaml"
    err = refusal(capsys, "train", recipe, "--resume", "--max-steps", "4")
    checkpoints = run_copy / "run" / "checkpoints"
    assert f"cannot write the checkpoint {checkpoints / 'step-000004.tmp'}: no space left on the device; the last " \
           f"complete checkpoint, {checkpoints / 'step-000003'}, is intact" in err
    assert not (checkpoints / "step-000004").exists()
    monkeypatch.setattr(drafttrain.drafts.base, "save_file", real)
    assert main(["train", str(recipe), "--resume", "--max-steps", "4"]) == 0
    assert (checkpoints / "step-000004" / "model.safetensors").is_file()


def test_a_file_size_limit_at_a_checkpoint_is_one_line(run_copy):
    """RLIMIT_FSIZE of 256 kB in the training process (SIGXFSZ ignored): the first file past it fails with EFBIG."""
    limit = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18)); sys.argv = sys.argv[1:]; "
             "runpy.run_module('drafttrain', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", limit, "drafttrain", "train", str(run_copy / "recipe.yaml"),
                           "--resume", "--max-steps", "3"], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    checkpoints = run_copy / "run" / "checkpoints"
    assert last.startswith(f"drafttrain train: error: cannot write the checkpoint {checkpoints / 'step-000003.tmp'}: ")
    assert "a file-size limit" in last and f"{checkpoints / 'step-000002'}, is intact" in last
    assert not (checkpoints / "step-000003").exists()


def test_a_full_disk_during_an_export_leaves_no_export(run_copy, capsys, monkeypatch):
    import drafttrain.export.writer

    monkeypatch.setattr(drafttrain.export.writer, "save_file", safetensors_full_disk)
    out = run_copy / "export"
    err = refusal(capsys, "export", run_copy / "run", "--format", "vllm", "--out", out)
    assert f"cannot write the export {out}: no space left on the device; nothing was replaced" in err
    assert not out.exists() and not out.with_name("export.partial").exists()


def test_a_full_disk_while_eval_writes_its_plots_leaves_no_half_plot(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from test_eval_metrics import synthetic_report

    from drafttrain.evaluation.report import write_report

    real = Figure.savefig

    def half_then_full(fig, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")  # what a full disk leaves: the start of the image
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    expected = f"cannot write the evaluation report {tmp_path}: no space left"
    with pytest.raises(DrafttrainError, match=re.escape(expected)):
        write_report(synthetic_report(), tmp_path)
    assert not (tmp_path / "acceptance.png").exists() and not (tmp_path / "acceptance.png.tmp").exists()
    monkeypatch.setattr(Figure, "savefig", real)
    assert write_report(synthetic_report(), tmp_path)["plot"].read_bytes().startswith(b"\x89PNG")


def test_a_full_disk_as_a_resumed_run_rewrites_its_log_keeps_the_log(tmp_path, monkeypatch):
    from drafttrain.config import parse_recipe
    from drafttrain.training.run_log import MetricsLog

    log_file = tmp_path / "metrics.jsonl"
    log_file.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    real_replace = os.replace

    def full_disk(src, dst, *args, **kwargs):
        if str(dst) == str(log_file):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full_disk)
    recipe = parse_recipe({"output_dir": str(tmp_path), "wandb": {"mode": "disabled"}})
    with pytest.raises(DrafttrainError, match=re.escape(f"cannot write the training log {log_file}: no space left on "
                                                        "the device; the checkpoints written so far are whole")):
        MetricsLog(recipe, total_steps=4, start_step=1, resumed=True)
    assert log_file.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def test_resume_in_a_read_only_run_folder_is_one_line(run_copy, capsys, monkeypatch):
    """Read-only made by monkeypatching the opens (os.open, and open for writing) under the run to raise EROFS."""
    run = run_copy / "run"
    real_os_open, real_open = os.open, builtins.open

    def read_only(path) -> None:
        if str(os.fspath(path)).startswith(str(run)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            read_only(path)
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and set(mode) & set("wax+"):
            read_only(file)
        return real_open(file, mode, *args, **kwargs)

    before = snapshot(run)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    err = refusal(capsys, "train", run_copy / "recipe.yaml", "--resume", "--max-steps", "3")
    assert f"cannot write the run folder (output_dir) {run}: the file system is read-only" in err
    monkeypatch.undo()
    assert snapshot(run) == before


# --------------------------------------------------------------------------------------------- secrets


def test_a_secret_in_the_recipe_reaches_no_summary_manifest_or_card(tmp_path, capsys, folder_target):
    """A token pasted into the recipe (an HF token as `regenerate.api_key_env`, an API key as the wandb project)
    is redacted, as logs redact them, in prepare_summary.json, every checkpoint's manifest and every file of the
    export (its card is what `push` uploads)."""
    recipe = tiny_recipe(tmp_path, folder_target, **TOKENS)
    secrets = [TOKENS["regenerate"]["api_key_env"], TOKENS["wandb"]["project"]]
    assert main(["prepare", str(recipe), "--no-progress"]) == 0
    assert main(["train", str(recipe)]) == 0
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--format", "vllm", "--out", str(out)]) == 0
    written = [tmp_path / "run" / "prepare_summary.json", *(tmp_path / "run" / "checkpoints").rglob("manifest.json"),
               *(p for p in out.rglob("*") if p.is_file())]
    assert (out / "README.md") in written and len(written) > 5
    leaks = [str(p) for p in written for secret in secrets if secret.encode() in p.read_bytes()]
    assert leaks == []
    assert "[REDACTED]" in (out / "README.md").read_text()
    assert "[REDACTED]" in json.loads((tmp_path / "run" / "prepare_summary.json").read_text())["recipe"]["wandb"][
        "project"]
    assert yaml.safe_load(recipe.read_text())["wandb"]["project"] == secrets[1]  # the user's recipe is theirs
