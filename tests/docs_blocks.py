"""The fenced blocks of README.md and docs/*.md, for the tests that check them against what the code does
(tests/integration/test_readme_outputs.py, tests/unit/test_cli_help.py, tests/unit/test_docs_examples.py). A block
is found by its text, not by the file it is in, so moving a section between the README and a guide keeps its test."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def block_after(first: str) -> str:
    """The text of the one fenced block, in README.md or a guide, that starts with the line(s) `first` (excluded)."""
    found = []
    for path in doc_files():
        text = path.read_text()
        for m in re.finditer(re.escape(first + "\n"), text):
            found.append(text[m.end():text.index("```", m.end())].rstrip())
    assert len(found) == 1, f"{len(found)} blocks start with {first!r} in README.md and docs/*.md (want one)"
    return found[0]


def fenced_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of each fenced block of a markdown file."""
    blocks, current, start = [], None, 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current, start = [], n + 1
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


@dataclass(frozen=True)
class Command:
    where: str          # "docs/data.md:98"
    argv: tuple         # the words after `shardtune`, up to a comment, a redirection or a `;`
    comment: str        # the text after `#`, or ""


def commands() -> list[Command]:
    """Every `shardtune ...` command line of a fenced block. In a block with `$ ` prompts only the prompted lines
    are commands (the rest is their output); a line ending in a backslash continues on the next."""
    found = []
    for path in doc_files():
        for start, lines in fenced_blocks(path):
            prompted = any(ln.startswith("$ ") for ln in lines)
            k = 0
            while k < len(lines):
                n, line = start + k, lines[k]
                while line.endswith("\\") and k + 1 < len(lines):
                    k += 1
                    line = line[:-1] + " " + lines[k].strip()
                k += 1
                if prompted:
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                if not line.startswith("shardtune "):
                    continue
                m = re.search(r"\s#(\s|$)", line)  # a shell comment: `#` after a space
                code, comment = (line[:m.start()], line[m.end():]) if m else (line, "")
                words = shlex.split(re.split(r"\s(?:>|;|\||&&)\s?", code)[0])
                found.append(Command(f"{path.relative_to(REPO)}:{n}", tuple(words[1:]), comment.strip()))
    return found
