"""Each Python interpreter's own CPU seconds, logged at its exit: which fresh processes (CLI commands, torchrun
agents, workers) a test suite starts and what each costs, where bench/process_cpu.py watches one command.

    INTERPRETER_CPU_LOG=/tmp/interp.jsonl PYTHONPATH=bench/interpreter_cpu .venv/bin/python -m pytest -q -n 2 \
        --dist loadfile --no-loadscope-reorder tests
    .venv/bin/python bench/interpreter_cpu/sitecustomize.py /tmp/interp.jsonl    # CPU-s by kind of process

Python imports `sitecustomize` at start-up from the path, so every interpreter started with that PYTHONPATH (in the
environment the tests pass on) registers the hook. Only the interpreter itself is counted (RUSAGE_SELF): a process
forked from it exits without running atexit and is not logged, nor is one killed by a signal.
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import time

_START, _PID = time.time(), os.getpid()


def _log() -> None:
    path = os.environ.get("INTERPRETER_CPU_LOG")
    if not path or os.getpid() != _PID:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"argv": sys.argv[:6], "cpu": usage.ru_utime + usage.ru_stime,
                                "wall": time.time() - _START}) + "\n")
    except OSError:
        pass


def _kind(argv: list[str]) -> str:
    """`shardtune validate`, `worker.py`, `-c` (xdist workers, rank servers): the program and, for ours, the command."""
    name = argv[0].rsplit("/", 1)[-1] if argv else "?"
    return f"{name} {argv[1]}" if name == "shardtune" and len(argv) > 1 else name


def report(path: str) -> None:
    kinds: dict[str, list[float]] = {}
    for line in open(path):
        row = json.loads(line)
        count_cpu = kinds.setdefault(_kind(row["argv"]), [0, 0.0])
        count_cpu[0] += 1
        count_cpu[1] += row["cpu"]
    print(f"{sum(n for n, _ in kinds.values())} interpreters, {sum(c for _, c in kinds.values()):.1f} CPU-s")
    for kind, (n, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"{cpu:8.1f} CPU-s {n:4d} x {cpu / n:5.2f}  {kind}")


if __name__ == "__main__":
    report(sys.argv[1])
else:
    atexit.register(_log)
