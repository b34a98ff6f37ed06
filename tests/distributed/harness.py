"""Start N gloo ranks and run one function over a grid of settings in one start (FSDP2's run_subtests pattern).

Ranks fork from a preloaded server (below), and a test still starts its ranks once and loops over its settings
inside: the process group and the model builds are paid once. A failing rank raises with its traceback and the
setting that failed; torch then terminates the other ranks (they would otherwise wait in a collective until the
gloo timeout).
"""
from __future__ import annotations

import datetime
import itertools
import os
import tempfile
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from tests import ranks


class RankFailure(RuntimeError):
    pass


def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """grid(a=[1, 2], b=["x"]) -> [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]"""
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(axes[k] for k in keys))]


def _worker(rank: int, world_size: int, store_path: str, fn: Callable[..., None],
            settings: list[dict[str, Any]], timeout_s: float) -> None:
    torch.set_num_threads(1)  # 2 cores shared by all ranks: more threads only oversubscribe
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for s in settings:
            try:
                fn(**s)
            except Exception as e:
                raise RankFailure(f"rank {rank}/{world_size}, setting {s}:\n{traceback.format_exc()}") from e
            dist.barrier()
    finally:
        dist.destroy_process_group()


# What the forkserver imports once per pytest process (tests/ranks.py), beyond the product's list.
PRELOAD = [*ranks.PRELOAD, "transformers.models.qwen2.modeling_qwen2", "peft", "shardtune.engine.shard",
           "tests.distributed.common"]


def run_distributed(fn: Callable[..., None], world_size: int, settings: list[dict[str, Any]] | None = None,
                    *, timeout_s: float = 120.0) -> None:
    """Run `fn(**s)` for each s in `settings` on `world_size` ranks. `fn` must be importable (module level)."""
    cuda = any(str(s.get("device", "")).startswith("cuda") for s in settings or [])
    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(_worker, (world_size, os.path.join(tmp, "store"), fn, settings or [{}], timeout_s), world_size,
                    cuda=cuda)


def start_ranks(entry: Callable[..., None], args: tuple, nprocs: int, *, cuda: bool = False) -> None:
    """`entry(rank, *args)` in `nprocs` processes forked from the preloaded server (spawned when `cuda`); raises if
    any rank fails."""
    ranks.start_local_ranks(entry, args, nprocs, preload=PRELOAD, cuda=cuda)
