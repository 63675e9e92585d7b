"""The README opens with exactly two commands (quickstart, tests), and CI runs the test command verbatim."""

import re

import yaml
from conftest import REPO

from drafttrain.config import parse_recipe


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (REPO / "README.md").read_text())


def test_readme_opens_with_two_commands_quickstart_then_tests():
    commands = readme_commands()
    assert len(commands) >= 2
    assert commands[0].endswith("drafttrain quickstart")
    assert "pytest" in commands[1]


def _commands(script: str) -> list[str]:
    """The lines of a CI script that run something (not comments, shell settings or set-up)."""
    return [line for line in (REPO / ".ci" / script).read_text().splitlines()
            if line and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readme_test_command_then_the_quickstart_in_a_fresh_environment():
    assert _commands("run") == [readme_commands()[1], ".ci/quickstart_fresh"]


def test_the_fresh_environment_runs_the_readme_first_command_verbatim():
    lines = _commands("quickstart_fresh")
    assert readme_commands()[0] in lines
    assert any(line.startswith("python -m venv") for line in lines)  # its own environment, no extras
    assert not any("[dev]" in line or "--system-site-packages" in line for line in lines)


def test_every_recipe_snippet_in_the_readme_and_the_guide_is_a_valid_recipe():
    documents = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    snippets = [(doc, snippet) for doc in documents
                for snippet in re.findall(r"```yaml\n(.+?)\n```", doc.read_text(), re.S)]
    assert snippets
    for doc, snippet in snippets:
        parse_recipe(yaml.safe_load(snippet), str(doc.relative_to(REPO)))
