"""Help texts: they point at nothing outside the repository, leave wrapping to rich (one string per paragraph),
state every option's default, and agree with the README's command synopsis (in both directions)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.main import get_command

from shardtune.launcher.cli import app
from tests.docs_blocks import fenced_blocks

REPO = Path(__file__).resolve().parents[2]
COMMANDS = get_command(app).commands  # name -> click command, as `shardtune --help` lists them


def _options(command) -> list:
    return [p for p in command.params if p.param_type_name == "option"]


def _texts(command) -> list[str]:
    return [command.help or "", *(p.help or "" for p in command.params)]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_names_only_documents_in_the_repository(name):
    for text in _texts(COMMANDS[name]):
        for doc in re.findall(r"[\w./-]+\.md\b", text):
            assert (REPO / doc).is_file(), f"`shardtune {name} --help` points at {doc}, which is not in the repo"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_paragraphs_are_not_hand_wrapped(name):
    for text in _texts(COMMANDS[name]):
        for paragraph in text.strip().split("\n\n"):
            assert "\n" not in paragraph.strip(), f"{name}: a hand-wrapped paragraph: {paragraph[:60]!r}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_states_its_default(name):
    for opt in _options(COMMANDS[name]):
        # typer appends "[default: X]" itself for a valued option with a default; flags and None say it in words.
        shown = opt.show_default and opt.default is not None and not opt.is_flag
        assert opt.required or shown or "default" in (opt.help or ""), f"{name} {opt.opts}: help has no default"


def _readme_synopsis() -> dict[str, str]:
    """`shardtune COMMAND ...` lines of the README's synopsis block (its block in which every line is a command)."""
    synopsis = [lines for _, lines in fenced_blocks(REPO / "README.md")
                if lines and all(ln.startswith("shardtune ") for ln in lines)]
    assert len(synopsis) == 1, f"README.md has {len(synopsis)} blocks of `shardtune` lines only (want one: the synopsis)"
    lines = {}
    for line in synopsis[0]:
        m = re.match(r"shardtune (\w+)\b(.*)", line)
        if m and m.group(1) not in lines:
            lines[m.group(1)] = m.group(2).split("#", 1)[0]
    return lines


def test_readme_synopsis_matches_the_cli():
    synopsis = _readme_synopsis()
    assert set(COMMANDS) <= set(synopsis), f"commands missing from the README synopsis: {set(COMMANDS) - set(synopsis)}"
    for name, command in COMMANDS.items():
        cli_opts = {o for p in _options(command) for o in p.opts}
        readme_opts = set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", synopsis[name]))
        assert readme_opts <= cli_opts, f"README lists {readme_opts - cli_opts} for `{name}`, the CLI has no such option"
        missing = [p.opts for p in _options(command) if not set(p.opts) & readme_opts]
        assert not missing, f"`shardtune {name}` options missing from the README synopsis: {missing}"
