"""Accounting: comm bytes vs ring theory, model-state bytes vs formula, peak live bytes during forward. The formulas
count every parameter in a gathered unit, the tables in the root: engine.vocab_parallel=false throughout (its own
traffic and memory: test_vocab_parallel.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, build_model, global_batch, num_targets, policy_for, token_loss_sum
from tests.distributed.harness import grid, run_distributed

from shardtune.engine.shard import shard_model
from shardtune.engine.wrap import find_units
from shardtune.memory import CpuMemoryTracker, snapshot_live_bytes


def ring(numel: int, elem: int, world: int) -> int:
    """Bytes one rank sends + receives in a ring all-gather or reduce-scatter of `numel` elements."""
    return 2 * (world - 1) * numel * elem // world


def unit_numels(model) -> list[int]:
    """Parameter count per unit (forward order) then the root, from the unsharded model (independent of engine)."""
    policy = policy_for(model, "full_shard", world=1, vocab_parallel=False)
    units = find_units(model, policy.unit_classes)
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return [sum(p.numel() for p in u.parameters()) for u in units] + [root]


def pad(n: int, w: int) -> int:
    return -(-n // w) * w


def expected_step_bytes(numels: list[int], strategy: str, world: int, ag_elem: int, rs_elem: int) -> int:
    """Forward + backward of one micro-step with gradient sync, per rank."""
    *blocks, root = numels
    if strategy == "no_shard":
        return sum(2 * ring(n, rs_elem, world) for n in numels)  # one all-reduce per unit
    s = 2 if strategy == "hybrid_shard" else world  # shard-group size
    total = 0
    for i, n in enumerate(numels):
        p = pad(n, s)
        regathers = 1 if strategy in ("full_shard", "hybrid_shard") and i < len(blocks) - 1 else 0
        total += (1 + regathers) * ring(p, ag_elem, s) + ring(p, rs_elem, s)
        if strategy == "hybrid_shard":
            total += 2 * ring(p // s, rs_elem, world // s)  # all-reduce of the reduced shard across replicas
    return total


def _comm(model_name: str, strategy: str, param_dtype: torch.dtype) -> None:
    world = dist.get_world_size()
    model = build_model(model_name)
    numels = unit_numels(model)
    sharded = shard_model(model, policy_for(model, strategy, world=world, param_dtype=param_dtype, vocab_parallel=False),
                          device=torch.device("cpu"))
    s = 1 if strategy == "no_shard" else (2 if strategy == "hybrid_shard" else world)
    assert [sum(f) for f in sharded.padded_numels()] == [pad(n, s) for n in numels]
    ids, labels = global_batch(0)
    before = sharded.comm_bytes()
    (token_loss_sum(model, ids.chunk(world)[dist.get_rank()], labels.chunk(world)[dist.get_rank()])
     / num_targets(labels)).backward()
    ag = torch.tensor([], dtype=param_dtype).element_size()
    assert sharded.comm_bytes() - before == expected_step_bytes(numels, strategy, world, ag, 4), strategy
    # Inference: one all-gather per unit per forward, nothing else.
    before = sharded.comm_bytes()
    with torch.no_grad():
        model(input_ids=ids[:1])
    expect = 0 if strategy == "no_shard" else sum(ring(pad(n, s), ag, s) for n in numels)
    assert sharded.comm_bytes() - before == expect


def test_comm_bytes_match_theory_2_ranks() -> None:
    run_distributed(_comm, 2, grid(model_name=["tiny-llama"], strategy=["full_shard", "shard_grad_op", "no_shard"],
                                   param_dtype=[torch.float32, torch.bfloat16]))


def test_comm_bytes_match_theory_4_ranks() -> None:
    run_distributed(_comm, 4, grid(model_name=["tiny-qwen2"], strategy=["full_shard", "hybrid_shard"],
                                   param_dtype=[torch.float32]))


def _memory(model_name: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(model_name)
    numels = unit_numels(model)
    full_bytes = sum(p.nbytes for p in model.parameters())
    live0 = snapshot_live_bytes()
    sharded = shard_model(model, policy_for(model, "full_shard", world=world, vocab_parallel=False), device=torch.device("cpu"))
    shard_bytes = sum(pad(n, world) // world * 4 for n in numels)
    # Model-state bytes: the formula, the engine's own count, and what is actually alive all agree.
    assert sharded.model_state_bytes() == shard_bytes
    extra = snapshot_live_bytes() - (live0 - full_bytes) - shard_bytes
    assert extra == 0, f"{extra} bytes alive beyond the shards after sharding"

    ids, labels = global_batch(0)
    ids, labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
    opt = adamw(sharded.optimizer_param_groups(0.1))
    (token_loss_sum(model, ids, labels) / num_targets(labels)).backward()
    assert sharded.model_state_bytes() == 2 * shard_bytes  # + sharded fp32 grads
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert sharded.model_state_bytes() == shard_bytes  # grads freed with set_to_none

    # Activation bytes of this forward, measured on an unsharded copy of the model.
    ref = build_model(model_name)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    loss = token_loss_sum(ref, ids, labels)
    activations = tracker.peak_bytes() - base
    tracker.stop()
    del ref, loss

    unit_bytes = [pad(n, world) * 4 for n in numels]  # gathered fp32 buffers
    *blocks, root = unit_bytes
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    loss = token_loss_sum(model, ids, labels)
    peak = tracker.peak_bytes() - base
    tracker.stop()
    bound = root + 2 * max(blocks) + blocks[-1] + activations
    assert peak <= bound, (peak, bound)
    # and the tracker does see the gathers: at least the root and one unit were live at once
    assert peak >= root + max(blocks), (peak, root + max(blocks))
    loss.backward()
    assert sharded.model_state_bytes() == 2 * shard_bytes

    # Accumulating without sync keeps every unit's unsharded fp32 gradient (what plan charges for it).
    sharded.set_requires_gradient_sync(False)
    (token_loss_sum(model, ids, labels) / num_targets(labels)).backward()
    assert sharded.model_state_bytes() == 2 * shard_bytes + sum(unit_bytes)
    sharded.set_requires_gradient_sync(True)
    (token_loss_sum(model, ids, labels) / num_targets(labels)).backward()
    assert sharded.model_state_bytes() == 2 * shard_bytes


def test_memory_accounting_2_ranks() -> None:
    run_distributed(_memory, 2, grid(model_name=["tiny-llama"]))
