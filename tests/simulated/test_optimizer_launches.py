"""Issue 58 defect 7: the optimizer phase of a LoRA step issues a number of kernels that does not grow with the
number of adapters (448 tensors at 8B), counted on the simulated GPU (CUDA's branches): the clip norm in one
multi-tensor call, the adapters' reduced gradients handed over (and, with engine.shard_adapter_states, the stepped
values gathered back) in one, AdamW's multi-tensor step. Counted: every ATen op dispatched on the device, views,
allocations and host reads of CPU scalars aside (simulated/launches.py counts the same way)."""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardtune.config.load import load_recipe
from shardtune.engine.replicated import ReplicatedParams
from shardtune.plan.simulate import _simulated_world
from tests.simulated.shallow import shallow_config

RECIPE = "tiny-lora-cpu"  # every Linear of the block adapted: 14 adapter tensors per layer


class _DeviceOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        on_device = any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0])
        if on_device and not func.is_view and name not in ("empty", "empty_like", "empty_strided", "lift_fresh"):
            self.ops[name] += 1
        return out


def _optimizer_ops(layers: int, world: int, overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Device ops of the second step's gradient hand-over (end of backward), clip, AdamW step and zero_grad."""
    from shardtune.trainer.train import setup, train_step

    mode = _DeviceOps()

    def counted(fn):
        def run(*a, **k):
            with mode:
                return fn(*a, **k)
        return run

    with tempfile.TemporaryDirectory() as tmp, _simulated_world(world, 1):
        recipe = load_recipe(RECIPE, [shallow_config(RECIPE, layers, Path(tmp)), "launch.device=cuda",
                                      "engine.cpu_offload=false", "train.micro_batch_size=1", "data.num_samples=200",
                                      f"train.output_dir={tmp}/run", *overrides])
        run = setup(recipe, simulated=True)
        run.model.train()
        train_step(run, 0, None)  # AdamW's state made
        monkeypatch.setattr(ReplicatedParams, "finish_reduce", counted(ReplicatedParams.finish_reduce))
        run.sharded.clip_grad_norm_ = counted(run.sharded.clip_grad_norm_)
        run.optimizer.step = counted(run.optimizer.step)
        run.optimizer.zero_grad = counted(run.optimizer.zero_grad)
        mode.ops.clear()
        train_step(run, 1, None)
        assert sum(p.requires_grad for p in run.model.parameters()) == 14 * layers
    monkeypatch.undo()
    return mode.ops


@pytest.mark.parametrize(("world", "overrides"), [
    (1, []),  # one GPU (the 8B and 1B LoRA recipes): gradients straight from autograd
    (2, ["engine.shard_adapter_states=false"]),  # adapters' gradients all-reduced in one bucket, handed over
    (2, ["engine.shard_adapter_states=true"]),  # each rank steps its run, the values all-gathered back
], ids=["1-gpu", "2-replicated", "2-sharded-states"])
def test_optimizer_phase_does_not_grow_with_the_adapters(world: int, overrides: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    few, many = (_optimizer_ops(layers, world, overrides, monkeypatch) for layers in (2, 8))
    assert "linalg_vector_norm" not in many and many["_foreach_norm"] == 1, many  # the clip norm: one call
    assert many == few, (few, many)  # 4x the adapter tensors, the same ops
