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


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [readme_commands()[1]]


def test_every_recipe_snippet_in_the_readme_is_a_valid_recipe():
    snippets = re.findall(r"```yaml\n(.+?)\n```", (REPO / "README.md").read_text(), re.S)
    assert snippets
    for snippet in snippets:
        parse_recipe(yaml.safe_load(snippet), "README.md")
