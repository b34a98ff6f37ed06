"""Issue-4 engine features, fp32 and bf16: mixed-precision collective dtypes, activation checkpointing (identical
losses, no gather inside recompute, activation memory falls), CPU offload (same numbers, host-resident states, the
reducer's host copies). Issue 13: async reductions bounded in flight; a backward that raises leaves it usable."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from tests.distributed.common import (
    adamw,
    build_model,
    global_batch,
    num_targets,
    policy_for,
    token_loss_sum,
    train_step,
)
from tests.distributed.harness import run_distributed

from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.shard import shard_model
from shardtune.engine.unit import ShardState
from shardtune.memory import CpuMemoryTracker

NUM_STEPS = 4


def _run(*, checkpoint_every: int | None = None, offload: bool = False, strategy: str = "full_shard",
         param_dtype=torch.float32, reduce_dtype=torch.float32, device: str = "cpu", steps: int = NUM_STEPS,
         vocab_parallel: bool = True):
    model = build_model("tiny-llama")
    policy = policy_for(model, strategy, world=dist.get_world_size(), param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype, vocab_parallel=vocab_parallel)
    policy = dataclasses.replace(policy, cpu_offload=offload)
    if checkpoint_every:
        apply_activation_checkpointing(model, policy.unit_classes, every_k=checkpoint_every)
    sharded = shard_model(model, policy, device=torch.device(device))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    losses = [train_step(model, sharded, opt, s, accum=2, sync_each=True, device=device) for s in range(steps)]
    return model, sharded, opt, losses


def _mixed_precision(reduce_dtype: torch.dtype) -> None:
    """bf16 all-gathers, reduce-scatter in reduce_dtype, fp32 sharded grads and master weights. With the tables in
    the root (engine.vocab_parallel=false): the counter's reduce-scatters are then the gradients' alone (the
    vocabulary tables' reduce-scatter activations, in the compute dtype)."""
    _, sharded, opt, _ = _run(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, steps=1, vocab_parallel=False)
    ops = {op: dtype for op, dtype in sharded.ctx.counter.calls}
    kinds = set(sharded.ctx.counter.calls)
    assert ("all_gather", torch.bfloat16) in kinds and ("all_gather", torch.float32) not in kinds, kinds
    assert {d for op, d in kinds if op == "reduce_scatter"} == {reduce_dtype}, kinds
    assert ops["all_reduce"] == torch.float32  # the clipping scalar
    assert all(f.dtype == torch.float32 and f.full.dtype == torch.bfloat16 for u in sharded.units for f in u.flats)
    # After backward, before the step: the accumulated sharded gradient is fp32 (accumulate in fp32).
    def grads_fp32() -> None:
        assert all(f.shard_grad() is None or f.shard_grad().dtype == torch.float32 for u in sharded.units
                   for f in u.flats)
        assert any(f.shard_grad() is not None for u in sharded.units for f in u.flats)

    train_step(sharded.module, sharded, opt, 1, accum=2, sync_each=True, before_step=grads_fp32)
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


def _checkpointing(every_k: int) -> None:
    _, _, _, plain = _run()
    model, sharded, _, ckpt = _run(checkpoint_every=every_k)
    assert ckpt == plain  # fp32: bit-identical losses and grad norms (recompute repeats the same ops)
    units = sharded.units[:-1]
    # Gathers per unit per micro-step equal the no-checkpointing ones: forward + backward (the last unit is kept
    # from forward); the recompute uses the backward gather, never a gather of its own.
    per_micro = [2] * (len(units) - 1) + [1]
    num_micro = 2 * NUM_STEPS
    assert [u.num_unshards for u in units] == [n * num_micro for n in per_micro]
    # Inside the recompute the unit stays gathered: record its state whenever its MLP runs during backward.
    states: list[tuple[int, ShardState]] = []
    def record(i: int, u):
        def hook(module, args) -> None:
            if sharded.ctx.step.in_backward:
                states.append((i, u.state))
        return hook

    for i, u in enumerate(units):
        u.module.mlp.register_forward_pre_hook(record(i, u))
    world, rank = dist.get_world_size(), dist.get_rank()
    ids, labels = global_batch(0)
    (token_loss_sum(model, ids.chunk(world)[rank], labels.chunk(world)[rank]) / num_targets(labels)).backward()
    recomputed = sorted({i for i, _ in states})
    assert recomputed == list(range(0, len(units), every_k)), states
    assert all(s is ShardState.UNSHARDED for _, s in states), states


def _activation_memory() -> None:
    """Peak bytes of one forward+backward (beyond resting state) fall with checkpointing: activations of a
    checkpointed unit are recomputed in backward instead of being kept from forward."""
    peaks = {}
    for every_k in (None, 1):
        model = build_model("tiny-llama")
        policy = policy_for(model, "full_shard", world=dist.get_world_size())
        if every_k:
            apply_activation_checkpointing(model, policy.unit_classes, every_k=every_k)
        sharded = shard_model(model, policy, device=torch.device("cpu"))
        ids = torch.randint(3, 128, (4, 128), generator=torch.Generator().manual_seed(0))
        tracker = CpuMemoryTracker().start()
        base = tracker.live_bytes()
        loss = token_loss_sum(model, ids, ids)
        peak_forward = tracker.peak_bytes() - base
        loss.backward()
        peaks[every_k] = (peak_forward, tracker.peak_bytes() - base)
        tracker.stop()
        del model, sharded, loss
    (fwd_plain, all_plain), (fwd_ckpt, all_ckpt) = peaks[None], peaks[1]
    assert fwd_ckpt < 0.6 * fwd_plain, peaks  # activations kept after forward: only the units' inputs
    assert all_ckpt < all_plain, peaks


def _offload(strategy: str, device: str = "cpu") -> None:
    """Offload: identical numbers; every reduced gradient goes through the reducer's host copy (pinned with CUDA)
    into host shard grads; shards and AdamW state on the host."""
    _, plain_sharded, _, plain = _run(strategy=strategy, device=device)
    assert plain_sharded.ctx.reducer.num_host_copies == 0
    grad_devices: list[tuple[str, bool]] = []

    def host_grads(sharded) -> None:
        grad_devices.extend((g.device.type, g.is_pinned()) for u in sharded.units for f in u.flats
                            if (g := f.shard_grad()) is not None)

    model, sharded, opt, offloaded = _run(strategy=strategy, offload=True, device=device)
    assert offloaded == plain
    reducer = sharded.ctx.reducer
    assert reducer.num_issued > 0 and reducer.num_host_copies == reducer.num_issued  # one D2H per reduction
    train_step(model, sharded, opt, NUM_STEPS, accum=2, sync_each=True, device=device,
               before_step=lambda: host_grads(sharded))
    assert grad_devices and set(grad_devices) == {("cpu", device == "cuda")}, grad_devices
    for u in sharded.units:
        for f in u.flats:
            assert f.shard.device.type == "cpu" and f.shard.is_pinned() == (device == "cuda")
            assert f.full.device.type == device
    for g in opt.param_groups:
        for p in g["params"]:
            assert p.device.type == "cpu" and all(t.device.type == "cpu" for t in opt.state[p].values())


def _in_flight(max_in_flight: int) -> None:
    """Reductions are asynchronous: while later units' backward runs, earlier units' reductions are pending, never
    more than the bound; all are done when backward returns."""
    model = build_model("tiny-llama")
    sharded = shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()),
                          device=torch.device("cpu"))
    reducer = sharded.ctx.reducer
    reducer.max_in_flight = max_in_flight
    seen: list[int] = []
    prev_gathered: list[bool] = []  # at that moment, with a reduction in flight: is the previous unit gathered?
    blocks = sharded.units[:-1]

    def starting(i: int) -> None:
        seen.append(reducer.pending())
        if i and reducer.pending():
            prev_gathered.append(blocks[i - 1].state is not ShardState.SHARDED)

    for i, u in enumerate(blocks):  # a hook on each unit's output: fires as that unit's backward starts
        u.module.register_forward_hook(_on_output_grad(lambda i=i: starting(i)))
    ids, labels = global_batch(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    token_loss_sum(model, ids.chunk(world)[rank], labels.chunk(world)[rank]).backward()
    units = len(sharded.units) - 1
    # Unit L-1 starts with nothing pending; unit i < L-1 while unit i+1's (and i+2's, ...) reduction is in flight,
    # except unit 0, the deepest point of the backward: everything is retired before it starts (engine/unit.py).
    assert seen == [min(k, max_in_flight) for k in range(units - 1)] + [0], seen
    # Never the next unit's gradient in flight and the previous unit gathered ahead at once: its gather is deferred
    # to the middle of this unit's backward (one unit less at the backward's peak).
    assert prev_gathered and not any(prev_gathered), prev_gathered
    assert reducer.pending() == 0 and reducer.num_issued == units + 1


def _on_output_grad(fn):
    """A forward hook calling `fn()` when the gradient of the module's (first) output is computed."""
    def hook(module, args, out) -> None:
        (out if isinstance(out, torch.Tensor) else out[0]).register_hook(lambda grad: fn())
    return hook


def _backward_raises(strategy: str, sync_each: bool) -> None:
    """A backward that raises (an OOM the caller catches) leaves the engine usable: the caller drops the step's
    gradients and redoes it; every loss equals a clean run's."""
    model = build_model("tiny-llama")
    sharded = shard_model(model, policy_for(model, strategy, world=dist.get_world_size()), device=torch.device("cpu"))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    armed = [False]

    def boom() -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected failure in backward")

    # Unit 1's backward: later units have issued their reductions, unit 0 is being prefetched.
    sharded.units[1].module.register_forward_hook(_on_output_grad(boom))
    losses = []
    for step in range(3):
        if step == 1:
            armed[0] = True
            with pytest.raises(RuntimeError, match="injected"):
                train_step(model, sharded, opt, step, accum=2, sync_each=sync_each)
            opt.zero_grad(set_to_none=True)
        losses.append(train_step(model, sharded, opt, step, accum=2, sync_each=sync_each))
    aborted, pending = sharded.ctx.step.num_aborted, sharded.ctx.reducer.pending()
    model = build_model("tiny-llama")
    sharded = shard_model(model, policy_for(model, strategy, world=dist.get_world_size()), device=torch.device("cpu"))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    clean = [train_step(model, sharded, opt, step, accum=2, sync_each=sync_each) for step in range(3)]
    assert losses == clean, (losses, clean)
    assert aborted == 1 and pending == 0


def _all(kind: str, **kw) -> None:
    {"mp": _mixed_precision, "ckpt": _checkpointing, "mem": _activation_memory, "offload": _offload,
     "in_flight": _in_flight, "raises": _backward_raises}[kind](**kw)


def test_engine_features_2_ranks() -> None:
    run_distributed(_all, 2, [dict(kind="mp", reduce_dtype=torch.float32), dict(kind="mp", reduce_dtype=torch.bfloat16),
                              dict(kind="ckpt", every_k=1), dict(kind="ckpt", every_k=2), dict(kind="mem"),
                              dict(kind="offload", strategy="full_shard"), dict(kind="offload", strategy="no_shard"),
                              dict(kind="in_flight", max_in_flight=1), dict(kind="in_flight", max_in_flight=2),
                              dict(kind="raises", strategy="full_shard", sync_each=True),
                              dict(kind="raises", strategy="full_shard", sync_each=False)])


def test_engine_features_4_ranks() -> None:
    run_distributed(_all, 4, [dict(kind="ckpt", every_k=1), dict(kind="offload", strategy="hybrid_shard"),
                              dict(kind="raises", strategy="hybrid_shard", sync_each=True)])


@pytest.mark.gpu
def test_offload_and_checkpointing_gpu() -> None:
    """One rank on the GPU (gloo cannot move CUDA tensors between ranks): H2D before gathers, pinned host states."""
    run_distributed(_all, 1, [dict(kind="offload", strategy="full_shard", device="cuda")])
