"""Run the CLI in-process (fast) and capture exit code, stdout and stderr."""
from __future__ import annotations

import sys

import pytest


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    from shardtune.launcher.cli import main

    old = sys.argv
    sys.argv = ["shardtune", *argv]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err
