"""Warnings as one line, once: `warning: MESSAGE`, without Python's source path and code line.

The CLI uses it for its own process; each worker too, where only rank 0 prints (every rank raises the same
warnings: a 2-worker run printed each twice) and another rank's warnings go to its log (file descriptor 2 is
`<run>/logs/rank_N.log` under our launcher, see trainer/worker.py), or nowhere when there is no log.
"""
from __future__ import annotations

import os
import sys
import warnings


def one_line_warnings(*, rank: int = 0, others_to_log: bool = False) -> None:
    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 (warnings' API)
        text = f"warning: {' '.join(str(message).split())}\n"
        if rank == 0:
            sys.stderr.write(text)
            sys.stderr.flush()
        elif others_to_log:
            os.write(2, text.encode())

    warnings.showwarning = show
