"""``drafttrain eval``'s flags: the decoding flags are generated from the schema (names, defaults, help), --top-k is
sampling's top-k and --tree-top-k the dynamic tree's, and --compare is parsed into a typed value. Nothing here
loads a model: the flags are parsed and validated as the command does before the target loads."""

from __future__ import annotations

import argparse
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from drafttrain import DrafttrainError
from drafttrain.commands import build_parser, main
from drafttrain.commands.eval import CompareSpec, add_arguments, eval_settings
from drafttrain.commands.schema_flags import FlagExtras, add_schema_flags
from drafttrain.config import DecodeSettings, EvalConfig

BASE = ["eval", "--target", "smollm2-135m-instruct", "--out", "out"]
# A value other than the default for every decode setting, with the flags it needs to be valid and to act.
NON_DEFAULTS: dict[str, tuple[list[str], Any]] = {
    "depth": (["--depth", "3"], 3),
    "max_depth": (["--max-depth", "6"], 6),
    "min_confidence": (["--min-confidence", "0.25"], 0.25),
    "tree": (["--tree", "medusa-16"], "medusa-16"),
    "total_tokens": (["--tree", "dynamic", "--total-tokens", "30"], 30),
    "tree_top_k": (["--tree", "dynamic", "--tree-top-k", "4"], 4),
    "temperature": (["--temperature", "0.7"], 0.7),
    "top_p": (["--temperature", "0.7", "--top-p", "0.9"], 0.9),
    "top_k": (["--temperature", "0.7", "--top-k", "50"], 50),
    "seed": (["--seed", "7"], 7),
    "max_new_tokens": (["--max-new-tokens", "12"], 12),
    "runtime_check": (["--no-runtime-check"], False),
}


def parsed(*flags: str) -> argparse.Namespace:
    argv = [*BASE, *flags]
    return build_parser(argv).parse_args(argv)


def settings_of(*flags: str) -> EvalConfig:
    return eval_settings(parsed(*flags))


def eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_every_decode_setting_has_a_flag_whose_default_is_the_schemas():
    actions = {action.dest: action for action in eval_parser()._actions}
    defaults = DecodeSettings()
    for name, field in DecodeSettings.model_fields.items():
        action = actions[name]
        flag = "--no-" if field.annotation is bool and field.default is True else "--"
        assert flag + name.replace("_", "-") in action.option_strings, name
        assert field.description and action.help.startswith(field.description), name  # the schema's help
        assert f"default: {field.default}" in action.help or field.annotation is bool, name
    settings = settings_of()
    # no flag given: every value is the schema's default, and none counts as given (a default depth is fitted)
    assert {n: getattr(settings, n) for n in DecodeSettings.model_fields} == defaults.model_dump()
    assert settings.model_fields_set == set()
    assert (settings.suite, settings.num_prompts) == (EvalConfig().suite, EvalConfig().num_prompts)


@pytest.mark.parametrize("name", list(DecodeSettings.model_fields))
def test_each_decode_flag_sets_its_own_field(name):
    assert set(NON_DEFAULTS) == set(DecodeSettings.model_fields)  # a new setting needs its case here
    flags, value = NON_DEFAULTS[name]
    settings = settings_of(*flags)
    assert getattr(settings, name) == value != DecodeSettings.model_fields[name].default
    assert name in settings.model_fields_set


def test_top_k_is_samplings_top_k_and_tree_top_k_the_trees():
    sampled = settings_of("--top-k", "50", "--temperature", "0.7")
    assert (sampled.top_k, sampled.tree_top_k) == (50, DecodeSettings().tree_top_k)
    assert sampled.sampling == {"temperature": 0.7, "top_p": 1.0, "top_k": 50}
    tree = settings_of("--tree", "dynamic", "--tree-top-k", "4")
    assert (tree.tree_top_k, tree.top_k) == (4, 0)
    both = settings_of("--tree", "dynamic", "--tree-top-k", "4", "--temperature", "0.7", "--top-k", "20")
    assert (both.tree_top_k, both.top_k) == (4, 20)


@pytest.mark.parametrize("flags", [["--tree", "dynamic", "--top-k", "8"], ["--top-k", "8"],
                                   ["--tree", "dynamic", "--top-k", "8", "--temperature", "0"]])
def test_top_k_at_temperature_0_is_refused_naming_tree_top_k(flags):
    with pytest.raises(DrafttrainError, match="--tree-top-k") as refused:
        settings_of(*flags)
    assert "\n" not in str(refused.value) and "sampling's top-k" in str(refused.value)


@pytest.mark.parametrize("flags", [["--top-p", "0.5"], ["--top-p", "0.5", "--temperature", "0"],
                                   ["--tree", "dynamic", "--top-p", "0.9"]])
def test_top_p_at_temperature_0_is_refused_like_top_k(flags):
    """--top-p 0.5 at temperature 0 was accepted and recorded in the report, though greedy decoding ignores it."""
    with pytest.raises(DrafttrainError, match="--top-p .* cannot act at temperature 0") as refused:
        settings_of(*flags)
    assert "\n" not in str(refused.value)
    assert settings_of("--top-p", "0.5", "--temperature", "0.7").top_p == 0.5


@pytest.mark.parametrize("flags, own", [(["--tree", "medusa-4", "--depth", "5"], 2),
                                        (["--tree", "medusa-16", "--depth", "2"], 4),
                                        (["--tree", "static:[[0], [0, 0], [0, 0, 0]]", "-k", "1"], 3)])
def test_a_depth_beside_a_static_tree_is_refused_naming_the_trees_own(flags, own):
    """--tree medusa-4 --depth 5 drafted depth 2 while the report said 5: a static tree drafts to its own depth."""
    with pytest.raises(DrafttrainError, match=f"--depth .* cannot act on --tree .* its own depth \\({own}\\)"):
        settings_of(*flags)
    tree = flags[1]
    assert settings_of("--tree", tree, "--depth", str(own)).depth == own  # its own depth, given, is the same
    assert settings_of("--tree", tree).tree == tree  # left out, the report gives the tree's own (test_eval_cli)


def test_a_recipes_depth_beside_its_static_tree_is_refused_before_training():
    from drafttrain.config import parse_recipe
    from drafttrain.evaluation.checkpoint_eval import check_eval_shape

    recipe = parse_recipe({"draft": {"kind": "medusa", "num_heads": 3}, "eval": {"tree": "medusa-4", "depth": 3}})
    with pytest.raises(DrafttrainError, match=r"eval.depth 3 cannot act on eval.tree medusa-4: .* own depth \(2\)"):
        check_eval_shape(recipe)
    check_eval_shape(parse_recipe({"draft": {"kind": "medusa", "num_heads": 3}, "eval": {"tree": "medusa-4"}}))


def test_the_old_meaning_of_top_k_exits_2_before_the_target_loads(tmp_path, capsys):
    code = main([*BASE[:-1], str(tmp_path / "out"), "--proposer", "prompt_lookup", "--tree", "dynamic",
                 "--top-k", "8"])
    assert code == 2
    assert "--tree-top-k 8" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_values_the_command_line_spells_its_own_way():
    assert settings_of("-k", "auto").depth == "auto"
    assert settings_of("--num-prompts", "all").num_prompts is None
    assert settings_of("--num-prompts", "3").num_prompts == 3
    assert settings_of("--questions", "q.jsonl").suite == "q.jsonl"


@pytest.mark.parametrize("flags, said", [(["--depth", "deep"], "expected an integer or 'auto'"),
                                         (["--num-prompts", "some"], "expected an integer or 'all'"),
                                         (["--tree-top-k", "x"], "invalid int value")])
def test_a_value_of_the_wrong_type_is_argparses_refusal(flags, said, capsys):
    with pytest.raises(SystemExit) as stop:
        parsed(*flags)
    assert stop.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("text, source, label, shape, depth, tree", [
    ("prompt_lookup", "prompt_lookup", None, "", None, None),
    ("prompt_lookup@3", "prompt_lookup", None, "3", 3, None),
    ("prompt_lookup@auto", "prompt_lookup", None, "auto", "auto", None),
    ("runs/medusa@tree:medusa-16", "runs/medusa", None, "tree:medusa-16", None, "medusa-16"),
    ("runs/eagle3@tree:auto", "runs/eagle3", None, "tree:auto", None, "auto"),
    ("short=prompt_lookup@1", "prompt_lookup", "short", "1", 1, None),
    ("eagle3=runs/a/imported", "runs/a/imported", "eagle3", "", None, None),
    ("runs/v=2/draft@2", "runs/v=2/draft", None, "2", 2, None),  # a "/" before "=": a path, not a label
])
def test_compare_forms(text, source, label, shape, depth, tree):
    spec = CompareSpec.parse(text)
    assert spec == CompareSpec(source, label, shape, shape_given="@" in text)
    assert (spec.depth, spec.tree, str(spec)) == (depth, tree, text)
    spec.check_shape()


def test_a_compared_folder_with_an_equals_sign_is_a_folder_not_a_label(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=3e-4").mkdir()
    assert CompareSpec.parse("lr=3e-4@2") == CompareSpec("lr=3e-4", None, "2", shape_given=True)
    assert CompareSpec.parse("lr=1e-3") == CompareSpec("1e-3", "lr", "")  # no such folder: a label


@pytest.mark.parametrize("text, said", [("@3", "no proposer or draft folder"),
                                        ("=prompt_lookup", "the LABEL before '=' is empty")])
def test_a_compare_that_names_nothing_is_argparses_refusal(text, said):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        CompareSpec.parse(text)
    assert said in str(refused.value) and text in str(refused.value)


@pytest.mark.parametrize("text, said", [
    ("prompt_lookup@deep", "@deep is neither a depth (@3, @auto) nor a tree (@tree:...)"),
    ("prompt_lookup@0", "@0 is neither a depth"),
    ("prompt_lookup@", "@ is neither a depth"),
    ("prompt_lookup@tree:", "@tree: is neither a depth"),
])
def test_a_compare_with_a_shape_that_is_none_is_refused_naming_it(text, said):
    with pytest.raises(DrafttrainError) as refused:
        CompareSpec.parse(text).check_shape()
    assert said in str(refused.value) and text in str(refused.value)


def test_a_bad_compare_exits_2_naming_the_cause(capsys):
    assert main([*BASE, "--proposer", "prompt_lookup", "--compare", "prompt_lookup@deep"]) == 2
    assert "neither a depth" in capsys.readouterr().err


def test_compare_values_are_collected_typed_and_the_namespace_keeps_them_as_given():
    args = parsed("--compare", "prompt_lookup@2", "--compare", "b=prompt_lookup@auto")
    assert args.compare == [CompareSpec.parse("prompt_lookup@2"), CompareSpec("prompt_lookup", "b", "auto", True)]
    before = vars(args).copy()
    eval_settings(args)
    assert vars(args) == before  # validating the flags leaves the namespace as argparse made it


class _Odd(BaseModel):
    ratio: float | None = None
    names: list[str] = []
    mode: Literal["a", "b"] = "a"


def test_the_generator_refuses_a_type_it_has_no_flag_for():
    with pytest.raises(TypeError, match="ratio may be None"):
        add_schema_flags(argparse.ArgumentParser(), _Odd, ["ratio"])
    with pytest.raises(TypeError, match="no command-line flag type for names"):
        add_schema_flags(argparse.ArgumentParser(), _Odd, ["names"])
    parser = argparse.ArgumentParser()
    add_schema_flags(parser, _Odd, ["ratio", "mode"], {"ratio": FlagExtras(none_word="none")})
    assert vars(parser.parse_args(["--ratio", "none", "--mode", "b"])) == {"ratio": None, "mode": "b"}
    assert vars(parser.parse_args(["--ratio", "0.5"])) == {"ratio": 0.5}
