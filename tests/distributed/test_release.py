"""A sharded model is garbage-collected once the user drops it, after training steps too (autograd keeps tensor
hooks on its C++ side, out of the cycle collector's sight: the engine's hooks must not hold units strongly)."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, build_model, policy_for, train_step
from tests.distributed.harness import grid, run_distributed

from shardtune.engine.shard import shard_model


def _released(strategy: str, steps: int) -> None:
    model = build_model("tiny-llama")
    sharded = shard_model(model, policy_for(model, strategy, world=dist.get_world_size()), device=torch.device("cpu"))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    for step in range(steps):
        train_step(model, sharded, opt, step, accum=1, sync_each=True)
    refs = [weakref.ref(model), weakref.ref(sharded), weakref.ref(sharded.units[0])]
    del model, sharded, opt
    gc.collect()
    assert all(r() is None for r in refs), [r() is not None for r in refs]


def test_sharded_model_is_released_2_ranks() -> None:
    run_distributed(_released, 2, grid(strategy=["full_shard", "no_shard"], steps=[0, 2]))
