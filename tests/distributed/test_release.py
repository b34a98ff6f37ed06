"""A sharded model is garbage-collected once the user drops it, after training steps too (autograd keeps tensor
hooks on its C++ side, out of the cycle collector's sight: the engine's hooks must not hold units strongly)."""
from __future__ import annotations

import gc
import os
import weakref

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, build_model, policy_for, train_step
from tests.distributed.harness import grid, run_distributed, start_ranks

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


def _worker_entry(rank: int, port: int, run_dir: str) -> None:
    """`run_worker` as torchrun starts it: the environment says rank and world, the worker makes the group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    from shardtune.config.load import load_recipe
    from shardtune.trainer import runtime, train
    from shardtune.trainer.worker import run_worker

    groups = []

    def init_and_watch(launch, **kwargs):
        rt = runtime.init_runtime(launch, **kwargs)
        groups.append(weakref.ref(dist.group.WORLD))
        return rt

    train.init_runtime = init_and_watch
    recipe = load_recipe("tiny-cpu", [f"train.output_dir={run_dir}", "data.num_samples=32", "data.seq_len=32",
                                      "train.max_steps=2", "train.save_every=1", "train.save_final=false",
                                      "train.demo_eval=false", "train.eval_every=0", "train.warmup_steps=0"])
    assert run_worker(recipe) == 0
    # Freed before the interpreter exits: a gloo group left for interpreter teardown can have its worker threads
    # destroyed unjoined (SIGABRT, "terminate called without an active exception", after a successful run).
    assert groups and groups[0]() is None, "the process group outlived run_worker"


def test_worker_frees_its_process_group(tmp_path) -> None:
    from shardtune.trainer.runtime import free_port

    start_ranks(_worker_entry, (free_port(), str(tmp_path / "run")), 2)
