"""Ranks on the simulated GPU (shardtune/accelerator.py): one process per rank, default group on the "simgpu"
backend (shardtune/simulated/process_group.py: meta tensors only, no bytes move, what NCCL refuses is refused) plus
the gloo host group.

At each collective the ranks of its group meet in the store and compare what they issued (op, shapes, dtypes,
devices, call site), so a skipped or mismatched collective fails with both sides named; a world of 8 costs 8 cheap
processes. Settings run in a loop inside one start, as in
tests/distributed/harness.py; the simulated GPU's record (accelerator.TRACE) is cleared before each.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.simulated import device as simulated_device
from tests.distributed.harness import RankFailure, start_ranks


def _worker(rank: int, world_size: int, store_path: str, fn: Callable[..., None],
            settings: list[dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    store = dist.FileStore(store_path, world_size)
    simulated_device.install()
    accelerator.init_process_group(accelerator.SIMULATED, rank=rank, world_size=world_size,
                                   timeout=datetime.timedelta(seconds=120), store=store)
    try:
        for s in settings:
            accelerator.TRACE.clear()
            try:
                fn(**s)
            except Exception as e:
                raise RankFailure(f"rank {rank}/{world_size}, setting {s}:\n{traceback.format_exc()}") from e
            dist.barrier(group=accelerator.host_group())
    finally:
        dist.destroy_process_group()
        accelerator.forget_host_group()


def run_simulated(fn: Callable[..., None], world_size: int, settings: list[dict[str, Any]] | None = None) -> None:
    """`fn(**s)` for each s in `settings` on `world_size` simulated-GPU ranks. `fn` must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(_worker, (world_size, os.path.join(tmp, "store"), fn, settings or [{}]), world_size)
