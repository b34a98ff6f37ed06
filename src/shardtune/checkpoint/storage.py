"""Which storage DCP saves to and loads from: its own file system on real devices; on the simulated device, storage
that moves no bytes and a load planner that keeps meta tensors (simulated/null_storage.py)."""
from __future__ import annotations

from typing import Any

import torch

from shardtune.accelerator import is_simulated


def storage_writer(device: torch.device, path: str) -> Any:
    if not is_simulated(device):
        return None  # DCP's own file system writer
    from shardtune.simulated.null_storage import NullWriter

    return NullWriter(path)


def storage_reader(device: torch.device, path: str) -> Any:
    if not is_simulated(device):
        return None
    from shardtune.simulated.null_storage import NullReader

    return NullReader(path)


def load_planner(device: torch.device) -> Any:
    if not is_simulated(device):
        return None  # DCP's default
    from shardtune.simulated.null_storage import NullLoadPlanner

    return NullLoadPlanner()
