"""CPU that gloo's own threads spend per collective, by thread name (Linux /proc), for small and large all-reduces
between 2 local ranks:

    .venv/bin/python bench/gloo_loop_cpu.py [OPS]

Why: a perf profile of the whole suite (bench/RESULTS.md, stop 53) put ~4 % of its CPU in threads named
`gloo_tcp_loop`, gloo's TCP event loop, calling epoll_wait ~270,000 times a second across the machine. This measures
that cost outside the suite: each rank runs OPS all-reduces of a given size back to back, and reports the CPU its
threads spent (main thread, gloo's loop, the process group's work threads) and the wall time, per op; the larger
sizes run fewer ops (OPS x 16 Ki / size, at least 10). The loop is
gloo's code (torch's bundled build), not ours; the figure says how much a test pays per collective.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_cpu import cpu_seconds  # bench/, on the path of this script and of its spawned ranks

SIZES = {"4 floats": 4, "64 Ki floats": 1 << 16, "4 Mi floats": 1 << 22}


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by thread name."""
    out: dict[str, float] = {}
    task = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(task):
        try:
            name, cpu = open(f"{task}/{tid}/comm").read().strip(), cpu_seconds(f"{task}/{tid}/stat")
        except OSError:  # the thread ended between listing and reading
            continue
        out[name] = out.get(name, 0.0) + cpu
    return out


def _rank(rank: int, port: int, ops: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for label, numel in SIZES.items():
        x = torch.ones(numel)
        n = max(ops * (1 << 14) // max(numel, 1 << 14), 10)  # fewer of the big ones
        dist.all_reduce(x)  # connect the pairs first
        before, t0 = thread_cpu(), time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        wall, after = time.perf_counter() - t0, thread_cpu()
        spent = {k: after[k] - before.get(k, 0.0) for k in after}
        if rank == 0:
            cols = "  ".join(f"{k} {1e3 * v / n:.3f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                             if v > 0)
            print(f"{label:>13}: {n:5d} ops, wall {1e3 * wall / n:.3f} ms/op; CPU ms/op by thread: {cols}", flush=True)
    dist.destroy_process_group()


def main(ops: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, ops), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
