"""Process-group set-up for one worker: device, backend (NCCL on GPUs, gloo on CPU), threads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtune.config.schema import LaunchConfig


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime(launch: LaunchConfig) -> Runtime:
    """Called inside a torchrun/srun worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device_type = launch.device_type()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if launch.threads_per_worker:
            torch.set_num_threads(launch.threads_per_worker)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain `python -m shardtune.worker` run: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=10), device_id=device if device_type == "cuda" else None)
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
