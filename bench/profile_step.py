"""Where a training step's time goes, per backend: torch.profiler over one step on each of 2 CPU ranks.

    .venv/bin/python bench/profile_step.py --layers 4      # prints rank 0's top ops (self CPU time) per backend
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import engine_vs_fsdp2 as bench
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from shardtune.config.dtypes import DTYPES


def worker(rank: int, world: int, store_path: str, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dtype = DTYPES[a.dtype]
    for b in bench.BACKENDS:
        model, sharded, opt = bench.build(a, b, dtype)
        bench.train_step(a, model, sharded, opt, 0)  # warm up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.train_step(a, model, sharded, opt, 1)
        if rank == 0:
            print(f"\n## {b}\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        del model, sharded, opt
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--rows", type=int, default=15)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "store"), a), nprocs=2, join=True)


if __name__ == "__main__":
    main()
