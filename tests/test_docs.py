"""What a user reads: every link in the README, BENCHMARKS.md and docs/ resolves; the recipe reference is generated
from the schema and names every key; the README scans (its size, its cells) and its results table names only
commands that exist; BENCHMARKS.md is one screen; nothing narrates how the project was built."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys

import pytest
from conftest import REPO

from drafttrain.commands import COMMANDS

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# words that narrate how the project was built rather than what it does
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
            "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+")
NARRATION = re.compile(r"\b((?:this|that|each|an? earlier|a later|the next|one|" + ORDINALS + r")\s+sessions?|"
                       r"session time|issues? \d+|the device tool|workplace)\b", re.I)


def documents() -> list:
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "scripts").rglob("*.md"))]


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert broken == []


def test_the_recipe_reference_is_generated_from_the_schema_and_names_every_key():
    tool = runpy.run_path(str(REPO / "scripts" / "tools" / "recipe_reference.py"))
    assert (REPO / "docs" / "recipe-reference.md").read_text() == tool["render"](), \
        "docs/recipe-reference.md is not current: run python scripts/tools/recipe_reference.py"
    text = (REPO / "docs" / "recipe-reference.md").read_text()
    for _, cls in tool["sections"]():
        for name in cls.model_fields:
            assert f"| `{name}` |" in text, name
    assert "| — |" not in text  # every key says what it does


def test_the_readme_scans():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < 10_000
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(len(c) for c in cells) <= 300


def test_the_readme_results_table_names_only_commands_that_exist():
    text = (REPO / "README.md").read_text()
    table = text.split("## Results at a glance")[1].split("\n## ")[0]
    named = re.findall(r"`drafttrain (\w+)", table)
    assert named and set(named) <= set(COMMANDS)
    for path in re.findall(r"`((?:recipes|scripts)/[^`\s]+)`", table):
        assert (REPO / path).exists(), path


def test_benchmarks_is_one_screen_of_headline_tables_that_link_their_studies():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) < 200
    studies = {p.name for p in (REPO / "docs" / "studies").glob("*.md")}
    linked = set(re.findall(r"docs/studies/([\w-]+\.md)", text))
    index = set(re.findall(r"studies/([\w-]+\.md)", (REPO / "docs" / "index.md").read_text()))
    assert studies <= linked | index, studies - linked - index


def test_each_study_puts_its_summary_first():
    for study in (REPO / "docs" / "studies").glob("*.md"):
        lines = [line for line in study.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# ") and lines[1].startswith("**Summary.**"), study.name


def test_nothing_narrates_how_the_project_was_built():
    tracked = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.yaml", "*.toml"], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    found = []
    for name in tracked:
        if name.startswith("tests/test_docs.py") or "/studies/" in name and not name.endswith(".md"):
            continue
        path = REPO / name
        if path.is_file():
            found += [f"{name}: {m.group(0)}" for m in NARRATION.finditer(path.read_text(errors="replace"))]
    assert found == []


def test_experiment_scripts_live_with_a_readme():
    experiments = REPO / "scripts" / "experiments"
    for topic in experiments.iterdir():
        assert (topic / "README.md").is_file(), topic.name
    assert sys.version_info >= (3, 10)


def test_no_list_item_lost_its_first_words():
    """A bullet that starts with punctuation is a sentence whose beginning was cut when the text was moved."""
    cut = re.compile(r"^\s*[-*] +[,;:.)]", re.M)
    found = [f"{doc.relative_to(REPO)}: {m.group(0).strip()}" for doc in documents()
             for m in cut.finditer(doc.read_text())]
    assert found == []
