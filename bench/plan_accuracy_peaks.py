"""The measured peaks of tests/integration/test_plan_accuracy.py's cases at one world size, and the time their
group took, written to a JSON file: run it from two trees and compare the files to check that a change to the
test harness or the trainer moved no byte of what the plan is checked against.

    PYTHONPATH=. .venv/bin/python bench/plan_accuracy_peaks.py 1 /tmp/after.json
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import tests.plan_accuracy as cases_of


def main() -> None:
    world = int(sys.argv[1])
    cases = (cases_of.default_grid() + cases_of.demo_grid(subset=True) + cases_of.qlora_grid() + cases_of.dpo_grid()
             + cases_of.vocab_grid(subset=True) + cases_of.long_context_grid() + cases_of.moe_grid())
    cases = [c for c in cases if c.world == world]
    start = time.time()
    peaks = cases_of.measure(cases, Path(tempfile.mkdtemp()))
    print(f"{len(cases)} cases at world {world}: {time.time() - start:.1f} s")
    with open(sys.argv[2], "w") as f:
        json.dump(dict(zip([c.name for c in cases], peaks)), f, indent=1)


if __name__ == "__main__":
    main()
