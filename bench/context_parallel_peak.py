"""engine.context_parallel's measured peak per rank on CPU: a tiny Llama at seq 8,192 (one document per row), 2
ranks, fp32, activation checkpointing, 3 steps, with and without offloaded inputs, each with and without context
parallelism; the plan's prediction beside each (the tests/plan_accuracy.py harness, one spawn).

    .venv/bin/python bench/context_parallel_peak.py      # ~1 min on 2 cores
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/

from tests import plan_accuracy as pa  # noqa: E402

GRID = [("checkpointing", (pa.CK,)), ("checkpointing, context parallel", (pa.CK, pa.CP)),
        ("offloaded inputs", (pa.CK, pa.OFF)), ("offloaded inputs, context parallel", (pa.CK, pa.OFF, pa.CP))]


def main() -> None:
    cases = [pa.Case(name, 2, (*pa.LONG, *extra, "train.max_steps=3"), own_model=False, long_docs=True,
                     doc_chars=pa.WHOLE_ROW_CHARS) for name, extra in GRID]
    with tempfile.TemporaryDirectory() as d:
        rows = pa.run(cases, Path(d))
    print("| configuration | measured MB | plan MB | plan error |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['measured'] / 1e6:.1f} | {r['predicted'] / 1e6:.1f} | {r['error']:+.1%} |")
    for plain, split in ((rows[0], rows[1]), (rows[2], rows[3])):
        print(f"{split['name']}: {split['measured'] / plain['measured']:.2f}x of {plain['name']}")


if __name__ == "__main__":
    main()
