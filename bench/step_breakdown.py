"""Where a training step's time goes on 2 CPU ranks (gloo): compute vs communication the rank waits for.

    .venv/bin/python bench/step_breakdown.py                   # both backends, fp32, model of engine_vs_fsdp2.py
    PYTHONPATH=<old checkout>/src .venv/bin/python bench/step_breakdown.py --backends shardtune   # another engine

On CPU the rank's one thread is its compute stream, so time spent inside a collective call or inside the wait of
its work handle is communication the step is exposed to; everything else (forward, backward, casts, optimizer) is
"compute". Both engines reach gloo through `torch.distributed`'s Python functions, so this bench wraps those
functions (and the work handles they return) with timers: the same instrument for ours and FSDP2, no change to
either engine. Classes: all-gather (all_gather_single / _into_tensor), reduce-scatter (reduce_scatter_single /
_tensor, and the send/recv of our gloo ring), all-reduce (clipping scalar and the loss; grads under hybrid).
An async collective counts only while the rank waits for it: an overlapped one costs ~0 here.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardtune.config.dtypes import DTYPES

sys.path.insert(0, str(Path(__file__).parent))
from engine_vs_fsdp2 import build, train_step  # noqa: E402  (the same model, policy and loop)

CLASSES = {"all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
           "reduce_scatter_single": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
           "isend": "reduce-scatter", "irecv": "reduce-scatter", "send": "reduce-scatter", "recv": "reduce-scatter",
           "all_reduce": "all-reduce"}


class CommTimer:
    """Seconds this thread spends inside wrapped collectives and their works' wait(), by class."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()
        self._depth = threading.local()  # a wrapped function calling another (deprecated aliases) counts once

    def install(self) -> None:
        for name, cls in CLASSES.items():
            setattr(dist, name, self._wrap(getattr(dist, name), cls))

    def _timed(self, cls: str, fn, *args, **kwargs):
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth.n = depth
            if depth == 0:
                self.seconds[cls] += time.perf_counter() - t0

    def _wrap(self, fn, cls: str):
        timer = self

        def wrapped(*args, **kwargs):
            work = timer._timed(cls, fn, *args, **kwargs)
            return _TimedWork(work, timer, cls) if work is not None and hasattr(work, "wait") else work
        return wrapped


class _TimedWork:
    def __init__(self, work, timer: CommTimer, cls: str) -> None:
        self._work, self._timer, self._cls = work, timer, cls

    def wait(self, *args, **kwargs):
        return self._timer._timed(self._cls, self._work.wait, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def worker(rank: int, world: int, store_path: str, a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    timer = CommTimer()
    timer.install()
    dtype = DTYPES[a.dtype]
    runs = {b: build(a, b, dtype) for b in a.backends.split(",")}
    rows: dict[str, list[dict[str, float]]] = {b: [] for b in runs}
    for i in range(a.warmup + a.steps):
        for b in (list(runs) if i % 2 == 0 else list(runs)[::-1]):  # alternate: load drift hits both
            model, sharded, opt = runs[b]
            dist.barrier()
            timer.seconds.clear()
            t0 = time.perf_counter()
            train_step(a, model, sharded, opt, i)
            step = time.perf_counter() - t0
            if i >= a.warmup:
                comm = dict(timer.seconds)
                rows[b].append({"step": step, **comm, "compute": step - sum(comm.values())})
    out = {b: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in ("step", "compute", "all-gather",
                                                                          "reduce-scatter", "all-reduce")}
           for b, rs in rows.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        print(f"\n{a.dtype}, Llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; {a.batch}x{a.seq} "
              f"tokens/rank; 2 ranks x {a.threads} thread, gloo; full_shard; median of {a.steps} steps; ms per step "
              "(exposed = the rank waits on it), per rank\n")
        print("| backend | rank | step | compute | exposed all-gather | exposed reduce-scatter | exposed all-reduce |")
        print("|---|---|---|---|---|---|---|")
        for r, res in enumerate(gathered):
            for b, m in res.items():
                print(f"| {b} | {r} | {1e3 * m['step']:.0f} | {1e3 * m['compute']:.0f} | "
                      f"{1e3 * m['all-gather']:.0f} | {1e3 * m['reduce-scatter']:.0f} | {1e3 * m['all-reduce']:.0f} |")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--backends", default="shardtune,fsdp2")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "store"), a), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
