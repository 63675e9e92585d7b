"""The package's layers: data -> targets -> drafts -> training -> decoding -> evaluation -> export -> commands,
on a foundation of shared rules (config, runfolder, sampling, cpu_linear). A module may import its own layer and
the layers below it, never one above, and no imports may go in a circle. Every import counts: module level,
inside functions, and module names given to importlib as strings. The checks are scripts/tools/check_structure.py's
(a developer runs the same scan by hand)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from drafttrain.config import DRAFT_KINDS, DRAFT_SECTIONS, DraftConfig
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.registry import KINDS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "check_structure.py"
_spec = importlib.util.spec_from_file_location("check_structure", SCRIPT)
structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(structure)


def test_every_module_belongs_to_a_layer():
    for module in structure.MODULES:
        structure.layer_of(module)


@pytest.mark.parametrize("module", sorted(structure.MODULES))
def test_no_module_imports_a_layer_above_its_own(module):
    mine = structure.LAYERS.index(structure.layer_of(module))
    upward = sorted(m for m in structure.GRAPH[module] if structure.LAYERS.index(structure.layer_of(m)) > mine)
    assert not upward, f"{module} ({structure.layer_of(module)}) imports from layers above it: {upward}"


def test_no_imports_go_in_a_circle():
    circles = structure.import_circles()
    assert not circles, " -> ".join(circles[0])


def test_the_checker_sees_what_it_must():
    """Guard: the parser finds lazy imports, relative imports, `from pkg import submodule` and importlib strings;
    the kind scan finds a kind named by string and by class; the function scan measures lengths."""
    graph = structure.GRAPH
    assert "drafttrain.drafts.losses" in graph["drafttrain.drafts.eagle3"]  # from drafttrain.drafts import losses
    assert "drafttrain.commands.prepare" in graph["drafttrain.commands"]  # a module name in a string
    assert list(itertools.islice(graph, 1))  # not empty
    names = structure.kind_names()
    assert set(names) == set(KINDS) and all(cls.__name__ in names[k] for k, cls in KINDS.items())
    lengths = {(m, name): n for m, name, n in structure.functions()}
    assert lengths[("drafttrain.evaluation.evaluate", "evaluate")] > 10


def test_no_function_is_over_80_lines_and_evaluate_over_60():
    assert not structure.long_functions()


def test_only_drafts_config_and_a_kinds_own_proposer_name_a_kind():
    """A kind is its registry entry: training/, evaluation/, export/, decoding/ (but the kind's own proposer)
    and commands/ ask the drafter, never name a kind."""
    assert not structure.named_kinds()


def test_no_side_of_an_evaluation_is_told_apart_by_a_string_prefix():
    assert not structure.string_prefix_roles()


def test_the_recipe_sections_are_the_registered_kinds():
    """Every kind's config_class is a section of the recipe schema under its own name, and every section is a kind."""
    assert {cls.config_class for cls in KINDS.values()} == set(DRAFT_SECTIONS)
    for kind, cls in KINDS.items():
        assert issubclass(cls.config_class, DraftConfig) and cls.config_class.model_fields["kind"].default == kind
        served = [engine for codec in codecs_of(cls).values() for engine in codec.engines]
        assert cls.description and served and codecs_of(cls), f"{kind} does not say its own facts"


def test_no_kind_branches_on_what_selects_its_variants():
    """A variant is a subclass (P-EAGLE of EAGLE-3, PARD of the draft model): neither the kind's class nor its
    proposer tests the section fields that select it, and nothing asks a draft getattr(..., "parallel")."""
    assert not structure.variant_flags()


def test_the_variant_scan_finds_a_flag_put_back(monkeypatch):
    """Guard: the scan reports the branch the variants replaced, once it is written back into the kind's class."""
    from drafttrain.drafts.eagle3 import Eagle3Drafter

    module = Eagle3Drafter.__module__
    source = structure.MODULES[module].read_text()
    flagged = source.replace("    def first_layer(", "    def flagged(self):\n        if self.config.parallel:\n"
                             "            return 1\n\n    def first_layer(", 1)
    assert flagged != source
    monkeypatch.setitem(structure.TREES, module, structure.ast.parse(flagged))
    assert any("parallel" in line and "PEagleDrafter" in line for line in structure.variant_flags())


def test_every_built_in_kind_is_one_entry_and_served_by_a_registered_proposer():
    """The built-in kinds are one list (drafts/registry.py BUILTIN_KINDS: class, variants, codecs); the section is
    the class's config_class, and its proposer, registered in the decoding layer above, is found by the class's name
    for it."""
    from drafttrain.decoding import PROPOSERS
    from drafttrain.drafts.registry import BUILTIN_KINDS, VARIANTS

    assert [entry.drafter for entry in BUILTIN_KINDS] == [KINDS[kind] for kind in DRAFT_KINDS]
    for entry in BUILTIN_KINDS:
        assert list(entry.variants) == VARIANTS.get(entry.drafter.kind, [])
        assert entry.drafter.proposer in PROPOSERS
        assert all(codecs_of(cls) for cls in (entry.drafter, *entry.variants))
