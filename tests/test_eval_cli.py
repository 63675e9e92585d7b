"""``drafttrain eval`` end to end on the real SmolLM2 target and the real decoding engine (no stand-ins), plus
every bad input ending in exit code 2 with a message that names the cause."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import draft_vocab_file

from drafttrain.commands import main
from drafttrain.evaluation.report import REQUIRED_METRIC_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(tmp_path, *extra: str) -> int:
    return main(["eval", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "out"), "--no-progress", *extra])


@pytest.mark.slow
def test_cli_prompt_lookup_run_writes_a_lossless_report(tmp_path, capsys, restore_threads):
    # two MT-Bench questions, both turns (the second asked after each side's own first answer)
    code = _eval(tmp_path, "--proposer", "prompt_lookup", "--suite", "mt_bench", "--num-prompts", "2",
                 "--max-new-tokens", "16", "--threads", "1", "--strict")
    assert code == 0, capsys.readouterr().err
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    for group in [report["overall"], *report["categories"].values()]:
        assert set(REQUIRED_METRIC_KEYS) <= set(group)
        assert set(group["acceptance_per_position"]) == {"conditional", "cumulative"}
        assert len(group["acceptance_per_position"]["cumulative"]) == 5  # default depth
    overall = report["overall"]
    assert overall["greedy_match"] == 1.0
    assert overall["num_prompts"] == 2 and report["config"]["num_turns"] == 4
    assert overall["tau"] >= 1.0 and overall["speedup"] > 0 and overall["tokens_per_s"] > 0
    assert 0 < overall["new_tokens"] <= 2 * 2 * 16
    config = report["config"]
    assert config["proposer"] == "prompt_lookup" and config["threads"] == 1 and config["suite"] == "mt_bench"
    assert {"torch", "transformers", "drafttrain"} <= set(config["versions"])
    for record in report["prompts"]:
        assert record["greedy_match"] is True and record["first_mismatch"] == [None, None]
        assert not any(isinstance(v, str) and len(v) > 40 for v in record.values())  # no generated text
        # the engine's per-depth counters agree with the per-step lists the metrics are computed from
        assert record["engine_position_accepted"][0] == sum(a >= 1 for a in record["accepted_per_step"])
        # each turn's first step drafts from its prompt; the contexts grow by the tokens each step emitted
        contexts = record["context_per_step"]
        assert len(contexts) == len(record["accepted_per_step"]) and contexts[0] == record["prompt_tokens"][0]
        assert record["prompt_tokens"][1] in contexts and record["prompt_tokens"][1] > contexts[0]
    assert sum(b["steps"] for b in overall["by_context"]) == overall["steps"]
    assert (out / "acceptance.png").read_bytes()[:8] == PNG_MAGIC
    assert "| **overall** |" in (out / "report.md").read_text()
    assert "speedup" in capsys.readouterr().out  # the console table


@pytest.mark.slow
def test_library_evaluate_with_hf_references(smollm2, restore_threads):
    """evaluate() as the trainer calls it; HF greedy must reproduce our plain-decode baseline token for token."""
    from drafttrain.evaluation import evaluate, load_suite

    torch.set_num_threads(1)  # on a shared 2-core CPU one thread is several times faster than two

    questions = load_suite("gsm8k").select(1)
    report = evaluate(smollm2, "prompt_lookup", questions, depth=3, max_new_tokens=8, hf_reference=True,
                      progress=False)
    assert report.greedy_match == 1.0
    assert set(report.references) == {"hf_generate", "hf_prompt_lookup"}
    for line in report.references.values():
        assert line["greedy_match_vs_baseline"] == 1.0 and line["speed_vs_baseline"] > 0
    assert report.references["hf_generate"]["tau_estimate"] == 1.0  # plain decoding: one token per forward
    assert report.config["depth"] == 3 and report.categories.keys() == {"math"}
    assert json.loads(report.to_json())["overall"]["new_tokens"] == report.overall["new_tokens"]


@pytest.mark.slow
def test_a_compared_proposer_runs_on_the_same_prompts_against_the_same_baseline(smollm2, restore_threads):
    from drafttrain.evaluation import evaluate, load_suite
    from drafttrain.evaluation.report import render_markdown

    torch.set_num_threads(1)
    questions = load_suite("mt_bench").select(2, turns="1")
    report = evaluate(smollm2, "prompt_lookup", questions, depth=4, max_new_tokens=24, compare=["prompt_lookup"],
                      progress=False)
    line = report.comparisons["prompt_lookup"]
    # The same deterministic proposer through the same engine: the same tokens, steps and acceptance.
    assert line["tau"] == report.overall["tau"] and line["acceptance_rate"] == report.overall["acceptance_rate"]
    assert line["greedy_match_vs_baseline"] == 1.0 and line["new_tokens"] == report.overall["new_tokens"]
    assert line["speed_vs_baseline"] > 0 and [c["label"] for c in report.config["compare"]] == ["prompt_lookup"]
    assert "same prompts, same run" in render_markdown(report)
    assert [(b["bucket"], b["steps"], b["tau"]) for b in line["by_context"]] == \
        [(b["bucket"], b["steps"], b["tau"]) for b in report.overall["by_context"]]


@pytest.mark.parametrize(
    "args, cause",
    [
        (["--proposer", "prompt_lookup", "--suite", "mtbench"], "unknown suite 'mtbench'"),
        (["--proposer", "magic"], "unknown proposer 'magic'"),
        (["--proposer", "prompt_lookup", "--depth", "0"], "--depth (k) must be positive"),
        (["--proposer", "prompt_lookup", "--depth", "-2"], "--depth (k) must be positive"),
        (["--proposer", "prompt_lookup", "--temperature", "-0.5"], "temperature must be a finite number >= 0"),
        (["--proposer", "prompt_lookup", "--temperature", "inf"], "temperature must be a finite number >= 0"),
        (["--proposer", "prompt_lookup", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        ([], "give --proposer"),
        (["--proposer", "prompt_lookup", "--num-prompts", "0"], "--num-prompts must be positive"),
        (["--proposer", "draft_model"], "needs --draft"),
        (["--proposer", "prompt_lookup", "--draft", "smollm2-135m-instruct"], "--draft is not used by proposer"),
        (["--proposer", "draft_model", "--draft", "/nonexistent/draft"], "draft not found: /nonexistent/draft"),
        (["--proposer", "prompt_lookup", "--tree", "static:[[0], [0, 0"], "neither a JSON list of paths"),
        (["--proposer", "prompt_lookup", "--tree", "bushy"], "unknown tree 'bushy'"),
        (["--proposer", "prompt_lookup", "--tree", "static:[[0], [2]]"], "skips a sibling"),
        (["--proposer", "prompt_lookup", "--compare", "magic"], "--compare magic: 'magic' is neither a draft-free"),
        (["--proposer", "prompt_lookup", "--compare", "draft_model"], "give the draft's checkpoint or run folder"),
        (["--proposer", "prompt_lookup", "--compare", "prompt_lookup@deep"], "neither a depth"),
        (["--proposer", "prompt_lookup", "--draft-vocab", "none"], "--draft-vocab is for the draft_model proposer"),
        (["--proposer", "draft_model", "--draft", "smollm2-135m-instruct", "--draft-vocab", "/no/vocab.safetensors"],
         "--draft-vocab: no such file /no/vocab.safetensors"),
    ],
)
def test_bad_input_exits_2_naming_the_cause(tmp_path, capsys, args, cause):
    assert _eval(tmp_path, *args) == 2
    assert cause in capsys.readouterr().err


@pytest.mark.slow
def test_a_draft_model_served_from_a_draft_vocabulary_stays_lossless(tmp_path, capsys, restore_threads):
    """The target as its own draft, drafting from half the vocabulary: still the target's greedy text, and the
    report records the vocabulary file it was served with."""
    vocab = draft_vocab_file(tmp_path, range(0, 49152, 2), 49152)
    code = _eval(tmp_path, "--proposer", "draft_model", "--draft", "smollm2-135m-instruct", "--draft-vocab",
                 str(vocab), "--suite", "gsm8k", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "12", "--depth", "2", "--threads", "1", "--strict", "--hf-reference")
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["overall"]["greedy_match"] == 1.0
    # HF assisted generation with the same draft: pinned to our draft length, and with HF's own defaults
    assert set(report["references"]) == {"hf_generate", "hf_assisted", "hf_assisted_default"}
    assert all(line["greedy_match_vs_baseline"] == 1.0 for line in report["references"].values())
    assert report["config"]["proposer_kwargs"]["vocab"] == str(vocab)


@pytest.mark.slow
def test_a_compared_draft_takes_a_named_tree(tmp_path, capsys, smollm2, restore_threads):
    """``--compare DRAFT@tree:medusa-4``: the named tree is resolved (it once reached the engine as a string)."""
    from drafttrain.config import MedusaConfig
    from drafttrain.drafts import build_drafter

    build_drafter(MedusaConfig(num_heads=2), smollm2).save_pretrained(tmp_path / "medusa")
    code = _eval(tmp_path, "--proposer", "prompt_lookup", "--suite", "gsm8k", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "8", "--depth", "2", "--threads", "1",
                 "--compare", f"{tmp_path / 'medusa'}@tree:medusa-4")
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    described = report["config"]["compare"][0]
    assert described["tree"]["kind"] == "static" and len(described["tree"]["paths"]) == 4
    assert report["comparisons"]["medusa@tree:medusa-4"]["greedy_match_vs_baseline"] == 1.0


def test_a_static_tree_reports_the_depth_it_drafted(tmp_path, capsys, folder_target, restore_threads):
    """A 3-head Medusa draft under --tree medusa-4 (two levels) was reported at depth 3, the default fitted to its
    heads, with a third acceptance position it never drafted; a compared side with the same tree likewise."""
    from drafttrain.config import MedusaConfig
    from drafttrain.drafts import build_drafter
    from drafttrain.targets import load_target

    torch.manual_seed(0)
    build_drafter(MedusaConfig(num_heads=3), load_target(str(folder_target))).save_pretrained(tmp_path / "medusa")
    code = main(["eval", "--target", str(folder_target), "--draft", str(tmp_path / "medusa"), "--tree", "medusa-4",
                 "--suite", "gsm8k", "--num-prompts", "1", "--turns", "1", "--max-new-tokens", "6", "--threads", "1",
                 "--no-progress", "--out", str(tmp_path / "out"), "--compare", f"{tmp_path / 'medusa'}@tree:medusa-4"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["config"]["depth"] == 2 and report["config"]["compare"][0]["depth"] == 2
    assert len(report["overall"]["acceptance_per_position"]["cumulative"]) == 2


def test_a_missing_draft_is_named_as_the_draft_not_the_target(tmp_path, capsys, monkeypatch):
    """`--draft runs/missing` (a folder's child, shaped like a Hub id) was tried as a Hub model and reported as
    "could not load target"; a Hub id that cannot be fetched is named as the draft model too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert _eval(tmp_path, "--draft", "runs/missing") == 2
    assert "draft not found: runs/missing" in capsys.readouterr().err
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here: fail at once
    assert _eval(tmp_path, "--draft", "nobody/no-such-draft") == 2
    err = capsys.readouterr().err
    assert "could not load draft model (--draft) 'nobody/no-such-draft'" in err and "could not load target" not in err


def test_empty_prompt_set_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _eval(tmp_path, "--proposer", "prompt_lookup", "--questions", str(empty)) == 2
    assert "empty prompt set" in capsys.readouterr().err


def _draft_with_other_tokenizer(folder):
    """A tiny random Llama whose tokenizer has one extra token: everything else matches the target's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    tokenizer.add_tokens(["<not-in-the-target>"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_mismatched_tokenizer_exits_2(tmp_path, capsys):
    draft = _draft_with_other_tokenizer(tmp_path / "draft")
    code = _eval(tmp_path, "--proposer", "draft_model", "--draft", str(draft), "--num-prompts", "1",
                 "--max-new-tokens", "4")
    assert code == 2
    assert "does not use the tokenizer" in capsys.readouterr().err


def test_greedy_verdict_warns_loudly_and_fails_only_when_strict(capsys):
    from drafttrain.commands.eval import _greedy_verdict

    assert _greedy_verdict(0.5, temperature=0.0, strict=True) == 1
    assert "WARNING" in capsys.readouterr().err
    assert _greedy_verdict(0.5, temperature=0.0, strict=False) == 0
    assert "50.0%" in capsys.readouterr().err
    assert _greedy_verdict(1.0, temperature=0.0, strict=True) == 0
    assert _greedy_verdict(None, temperature=0.7, strict=True) == 0  # no exact-match check when sampling
    assert capsys.readouterr().err == ""


def test_tree_specs(tmp_path):
    from drafttrain.decoding import DynamicTree
    from drafttrain.decoding.trees import tree_from_spec as parse_tree

    assert parse_tree("chain", 5, 60, 10) == "chain"
    assert parse_tree("dynamic", 6, 50, 8) == DynamicTree(total_tokens=50, depth=6, top_k=8)
    assert parse_tree("static:[[0], [1], [0, 0]]", 5, 60, 10).paths == [[0], [1], [0, 0]]
    paths = tmp_path / "tree.json"
    paths.write_text("[[0], [0, 0]]")
    assert parse_tree(f"static:{paths}", 5, 60, 10).paths == [[0], [0, 0]]
    assert parse_tree(str(paths), 5, 60, 10).paths == [[0], [0, 0]]  # a file of paths, named as it is
    assert len(parse_tree("medusa-16", 5, 60, 10)) == 16


@pytest.mark.slow
def test_depth_auto_chooses_on_held_out_prompts_and_reports_its_choice(tmp_path, restore_threads):
    code = _eval(tmp_path, "--proposer", "prompt_lookup", "--suite", "mt_bench", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "8", "--depth", "auto", "--max-depth", "3", "--threads", "1")
    assert code == 0
    config = json.loads((tmp_path / "out" / "report.json").read_text())["config"]
    auto = config["depth_auto"]
    assert set(auto) >= {"depth", "min_confidence", "predicted_speedup", "predicted_speedup_by_depth", "verify_ms"}
    assert 0 <= auto["depth"] <= 3 and len(auto["verify_ms"]) == 4 and auto["calibration_steps"] > 0
    assert "(auto: depth" in (tmp_path / "out" / "report.md").read_text()


def test_compared_sides_with_their_own_depths_each_run_and_auto_gets_held_out_prompts(tmp_path, restore_threads):
    """The main side at a fixed depth, the same proposer compared @1 and @auto: both run under their own labels
    (one used to replace the other), and the calibration prompts are loaded for @auto."""
    code = _eval(tmp_path, "--proposer", "prompt_lookup", "--suite", "mt_bench", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "8", "--depth", "2", "--max-depth", "3", "--compare", "prompt_lookup@1",
                 "--compare", "prompt_lookup@auto", "--threads", "1")
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    one, auto = report["config"]["compare"]
    assert (one["label"], one["depth"], auto["label"]) == ("prompt_lookup@1", 1, "prompt_lookup@auto")
    assert auto["depth_auto"]["calibration_steps"] > 0
    assert set(report["comparisons"]) == {"prompt_lookup@1", "prompt_lookup@auto"}


def test_compared_sides_take_the_labels_given(tmp_path, restore_threads):
    """``--compare LABEL=SIDE``: two drafts in folders of the same name (runs/a/imported, runs/b/imported) could not
    be told apart, and the error asked for labels there was no way to give."""
    code = _eval(tmp_path, "--proposer", "prompt_lookup", "--suite", "mt_bench", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "8", "--depth", "2", "--compare", "short=prompt_lookup@1",
                 "--compare", "long=prompt_lookup@3", "--threads", "1")
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(side["label"], side["depth"]) for side in report["config"]["compare"]] == [("short", 1), ("long", 3)]
    assert set(report["comparisons"]) == {"short", "long"}


def test_a_plain_model_folder_is_compared_as_it_is_served_as_the_draft(tmp_path, restore_threads):
    """Another trainer's draft model (TRL's GKD writes a plain HF folder) beside the run's own draft: --compare
    serves a plain model folder with the draft-model proposer, as --draft does, so the same folder on both sides
    drafts the same tokens."""
    from drafttrain.drafts.draft_model import cut_from_target
    from drafttrain.targets import load_target

    target = load_target("smollm2-135m-instruct")
    plain = tmp_path / "plain"
    cut_from_target(target, "first:2").save_pretrained(str(plain))
    target.tokenizer.save_pretrained(str(plain))
    code = _eval(tmp_path, "--draft", str(plain), "--suite", "mt_bench", "--num-prompts", "1", "--turns", "1",
                 "--max-new-tokens", "8", "--depth", "2", "--compare", f"again={plain}@2", "--threads", "1")
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["config"]["compare"][0]["label"] == "again"
    assert report["comparisons"]["again"]["tau"] == report["overall"]["tau"]
    assert report["comparisons"]["again"]["greedy_match_vs_baseline"] == 1.0


@pytest.mark.parametrize("flags", [["--temperature", "0.8", "--tree-top-k", "1"], ["--total-tokens", "30"],
                                   ["--tree", "medusa-16", "--tree-top-k", "4"]])
def test_a_dynamic_tree_flag_on_another_shape_is_refused_before_the_target_loads(tmp_path, capsys, flags):
    """`--temperature 0.8 --top-k 1` and `--top-k 10` gave identical tokens: --top-k sets the dynamic tree's
    expansion, and on a chain nothing read it (the report said top_k 0). A flag that cannot act is refused."""
    assert _eval(tmp_path, "--proposer", "prompt_lookup", *flags) == 2
    err = capsys.readouterr().err
    assert "shape the dynamic tree (--tree dynamic) and cannot act" in err and "not sampling's top-k" in err
    assert not (tmp_path / "out").exists()
