"""The settings matrix on the simulated GPU (matrix.py): every pair of settings runs a step, a save, a resume and an
export, every rank a process, every collective matched across ranks, the step under CUDA's allocator model. One
start of ranks per world size; each row is its own test, reading its outcome from that start. Rows that fail on a
defect another branch fixes are strict xfails (matrix.known_failure)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.runs import forked_cli
from tests.simulated import matrix
from tests.simulated.harness import run_simulated

ROWS, REFUSED = matrix.covering_array()
_OUTCOMES: dict[int, dict[str, str | None]] = {}


def _outcomes(world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    if world not in _OUTCOMES:
        base = tmp_path_factory.mktemp(f"matrix-w{world}")
        results = base / "results"
        results.mkdir()
        rows = [r for r in ROWS if r["world"] == world]
        run_simulated(matrix.run_rows, world, [{"base": str(base), "rows": rows, "results": str(results)}])
        per_rank = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
        assert len(per_rank) == world
        _OUTCOMES[world] = {rid: next((r[rid] for r in per_rank if r[rid] is not None), None) for rid in per_rank[0]}
    return _OUTCOMES[world]


def _param(row: matrix.Row):
    reason = matrix.known_failure(row)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(row, id=matrix.row_id(row), marks=marks)


def test_every_pair_is_covered():
    runs = {(a, r[a], b, r[b]) for r in ROWS for a in matrix.FACTORS for b in matrix.FACTORS if a < b}
    want = {(a, va, b, vb) for a in matrix.FACTORS for b in matrix.FACTORS if a < b
            for va in matrix.FACTORS[a] for vb in matrix.FACTORS[b]}
    refused = {(a, r[a], b, r[b]) for r, _ in REFUSED for a in r for b in r if a < b}
    assert want - runs <= refused and len(ROWS) <= 26
    assert {4, 8} <= {r["world"] for r in ROWS if r["strategy"] == "hybrid_shard"}  # hybrid 2x2 and 2x4


@pytest.mark.parametrize("row", [_param(r) for r in sorted(ROWS, key=lambda r: r["world"])])
def test_row_runs_on_the_simulated_gpu(row, tmp_path_factory):
    failure = _outcomes(row["world"], tmp_path_factory)[matrix.row_id(row)]
    assert failure is None, f"{matrix.overrides(row)}:\n{failure}"


# Each refused pair, and one row that runs: `shardtune validate` (the CLI's `main`, forked from the preloaded server:
# tests/integration/runs.py `forked_cli`) gives the answer the array was built with (the same load_recipe, in process).
# One row per distinct refusal: the pairs the array could not run often share one reason (offloaded activations
# without checkpointing, with each long-context value), and each check builds the model on meta.
@pytest.mark.parametrize("row,reason", [*{reason: (row, reason) for row, reason in REFUSED}.values(), (ROWS[0], None)])
def test_validate_agrees_with_the_matrix(row, reason):
    res = forked_cli("validate", matrix.recipe(row), *matrix.BASE, *matrix.overrides(row), cwd=Path.cwd())
    if reason is None:
        assert res.returncode == 0, res.stderr
    else:  # one line naming the key, exit 2
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and reason in res.stderr, res.stderr
