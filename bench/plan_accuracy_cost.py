"""What each row of tests/integration/test_plan_accuracy.py costs: CPU and wall seconds of `train()` per rank.

    .venv/bin/python bench/plan_accuracy_cost.py 2      # the test's world-2 rows (24), ~1.5 min on 2 idle cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_accuracy_cost.py 1 --profile /tmp/pa.prof   # + rank 0 under cProfile

The rows and their spawn are the test's (tests/plan_accuracy.py `measure`); only `train()` is timed. Prints one line
per row: CPU-s of each rank, then the wall seconds of rank 0. `--profile FILE`: rank 0 runs all its rows under
cProfile (which slows Python-heavy code), writes the stats to FILE and prints the functions of most own time.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/

import tests.plan_accuracy as accuracy  # noqa: E402

_MEASURE_WORKER = accuracy._worker
_PROFILE_ENV = "PLAN_ACCURACY_PROFILE"  # read by the forked rank 0 (the forkserver starts with this environment)


def _timed_worker(rank: int, world: int, port: int, jobs: list) -> None:
    """The test's rank, with `train()` timed into <output_dir>/cost_rank<N>."""
    import shardtune.trainer.train as trainer

    train = trainer.train

    def timed(recipe) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        train(recipe)
        cost = f"{time.process_time() - cpu:.2f} {time.perf_counter() - wall:.2f}"
        (Path(recipe.train.output_dir) / f"cost_rank{rank}").write_text(cost)

    trainer.train = timed
    profile = os.environ.get(_PROFILE_ENV) if rank == 0 else None
    if not profile:
        return _MEASURE_WORKER(rank, world, port, jobs)
    import cProfile

    with cProfile.Profile() as prof:
        _MEASURE_WORKER(rank, world, port, jobs)
    prof.dump_stats(profile)


def main(world: int, profile: str | None = None) -> None:
    import tempfile

    if profile:
        os.environ[_PROFILE_ENV] = profile

    cases = [c for _, rows in accuracy.suite_tables() for c in rows if c.world == world]  # the test's, in order
    accuracy._worker = _timed_worker  # measure() starts its ranks with the module's _worker
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        accuracy.measure(cases, Path(tmp))
        total = time.perf_counter() - start
        for i, case in enumerate(cases):
            costs = [(Path(tmp) / f"run{i}" / f"cost_rank{r}").read_text().split() for r in range(world)]
            cpu = " ".join(f"{c[0]:>6}" for c in costs)
            print(f"{case.name:<48} CPU-s per rank {cpu}   wall {costs[0][1]:>6}")
    print(f"{len(cases)} rows at world {world}: {total:.1f} s (spawn included)")
    if profile:
        import pstats

        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]), args[args.index("--profile") + 1] if "--profile" in args else None)
