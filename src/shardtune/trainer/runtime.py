"""Process-group set-up for one worker: device, backend (NCCL on GPUs, gloo on CPU; accelerator.py), threads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtune import accelerator
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


def init_runtime(launch: LaunchConfig, *, simulated: bool = False,
                 compute_dtype: torch.dtype = torch.float32) -> Runtime:
    """Called inside a torchrun/srun worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set). `simulated`: the
    simulated GPU (accelerator.py) instead of launch.device; the process group may already be set up (tests).
    `compute_dtype`: engine.mixed_precision's (fp32 matmuls of a bf16 run take TF32 on a GPU)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if simulated:
        from shardtune.simulated import device as simulated_device

        simulated_device.install()
        device = accelerator.SIMULATED
    else:
        device = accelerator.compute_device(launch.device_type(), local_rank)
    accelerator.set_matmul_precision(device, compute_dtype)
    if launch.threads_per_worker:  # every device: a GPU run's host work (offload's AdamW, adds, norms) uses them
        torch.set_num_threads(launch.threads_per_worker)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        if "MASTER_ADDR" not in os.environ:  # a plain `python -m shardtune.trainer.worker` run: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        accelerator.init_process_group(device, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_max(value: float) -> float:
    """The largest of a host number over the ranks, on the host group (gloo): no device read, so no host sync."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=accelerator.host_group())
    return float(t)
