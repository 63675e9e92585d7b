"""The quickstart end to end on a shrunken recipe: one line per stage on the console, the libraries' logs in the
run folder's quickstart.log, and the final table."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from drafttrain.commands import main


@pytest.mark.slow
def test_quickstart_prints_stages_and_a_table_and_logs_the_rest(tmp_path, monkeypatch, capfd, restore_threads):
    monkeypatch.chdir(REPO)  # the recipe's data paths are relative to the repository root
    run = tmp_path / "quick"
    code = main(["quickstart", f"output_dir={run}", "data.num_samples=8", "regenerate.max_new_tokens=16",
                 "training.max_steps=3", "training.save_every=3", "eval.num_prompts=1", "eval.max_new_tokens=8",
                 "eval.depth=auto", "eval.max_depth=2", "wandb.mode=offline"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    for stage in ("[1/3] prepare", "[2/3] train", "[3/3] evaluate"):
        assert stage in out
    for row in ("the head at depth 2: τ", "tokens per target forward", "acceptance per position",
                "speedup over plain decoding", "depth auto", "report: ", "plot: ", "quickstart.log"):
        assert row in out
    # a 3-step head pays nowhere: depth auto serves plain decoding, and the table still shows the head itself
    assert re.search(r"depth auto\s+│ plain decoding: on this machine no depth pays", out)
    assert re.search(r"τ\s+│ \d\.\d\d tokens per target forward", out)
    assert re.search(r"acceptance per position\s+│ d1 \d+%", out)
    assert "Why plain decoding wins here: a depth-2 cycle costs" in out
    assert "Projection from the measured τ, not measured" in out
    console = out + err
    for noise in ("[WARNING] [real_accelerator", "wandb:", "Saving current state", "trainable parameters", "step=1 "):
        assert noise not in console, noise
    log = (run / "quickstart.log").read_text()
    assert "Saving current state" in log and "trainable parameters" in log
    assert (run / "eval" / "report.md").is_file() and (run / "eval" / "acceptance.png").is_file()
