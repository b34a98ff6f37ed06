"""A pytest plugin: the CPU seconds of each test's process tree, for finding where the suite's time goes.

    CPU_PER_TEST_DIR=/tmp/cpu PYTHONPATH=bench .venv/bin/python -m pytest -q -n 2 --dist loadfile \
        --no-loadscope-reorder -p cpu_per_test tests
    python bench/cpu_per_test.py /tmp/cpu          # CPU-s and seconds held, per file, costliest first

At each test's start and end it sums utime + stime + cutime + cstime (Linux /proc/<pid>/stat) over this process and
its live descendants. A child that exits is reaped by its parent and its time moves into the parent's cumulative
times, so CLI runs and forked ranks are counted; processes outside the tree (SLURM job steps, under slurmd) are
not. Each process writes `<dir>/<pid>.jsonl`; xdist's controller writes one too (its tree holds both workers: the
report skips the file whose tests are the union of the others').
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK")
_START: dict[str, tuple[float, float]] = {}


def _tree_cpu(root: int) -> float:
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / _HZ


def pytest_runtest_logstart(nodeid, location):
    _START[nodeid] = (_tree_cpu(os.getpid()), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    cpu, wall = _START.pop(nodeid)
    out = Path(os.environ.get("CPU_PER_TEST_DIR", "cpu_per_test"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"id": nodeid, "cpu": round(_tree_cpu(os.getpid()) - cpu, 2),
                            "wall": round(time.monotonic() - wall, 2)}) + "\n")


def report(folder: Path) -> None:
    runs = {p: [json.loads(line) for line in p.read_text().splitlines()] for p in folder.glob("*.jsonl")}
    ids = {p: {r["id"] for r in rows} for p, rows in runs.items()}
    workers = [p for p in runs if len(runs) == 1 or ids[p] != set().union(*(ids[q] for q in runs if q != p))]
    cpu, held = Counter(), Counter()
    for p in workers:
        for r in runs[p]:
            cpu[r["id"].split("::")[0]] += r["cpu"]
            held[r["id"].split("::")[0]] += r["wall"]
    print(f"{sum(cpu.values()):8.1f} CPU-s in all")
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} {held[name]:8.1f}  {name}")


if __name__ == "__main__":
    report(Path(sys.argv[1]))
