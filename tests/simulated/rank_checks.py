"""Collectives the simulated GPU must refuse, run inside simulated ranks (test_rank_checks.py). Each case runs on
a fresh group (its own sequence numbers), so an earlier case's desynchronisation cannot leak into the next."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.simulated.process_group import CollectiveMismatch, RefusedTensor, set_check_timeout

SIM = accelerator.SIMULATED


def _fresh_group() -> dist.ProcessGroup:
    return dist.new_group(list(range(dist.get_world_size())))


def skipped_collective() -> None:
    """The last rank skips an all-reduce the others enter: they fail (naming the op, the call site and the rank
    that never came) instead of hanging."""
    group, rank, last = _fresh_group(), dist.get_rank(), dist.get_world_size() - 1
    if rank == last:
        return
    with pytest.raises(CollectiveMismatch) as e:
        dist.all_reduce(torch.zeros(4, device=SIM), group=group)
    msg = str(e.value)
    assert "all_reduce #0" in msg and f"rank(s) [{last}] did not enter it" in msg, msg
    assert "tests/simulated/rank_checks.py" in msg and "skipped_collective" in msg, msg  # the call site


def shape_mismatch() -> None:
    group = _fresh_group()
    with pytest.raises(CollectiveMismatch) as e:
        dist.all_reduce(torch.zeros(4 + dist.get_rank(), device=SIM), group=group)
    assert "differs across ranks" in str(e.value) and "[[4], 'float32', 'meta']" in str(e.value), str(e.value)
    assert "[[5], 'float32', 'meta']" in str(e.value) and "shape_mismatch" in str(e.value)


def op_mismatch() -> None:
    """Rank 0 all-gathers while the others reduce-scatter, same shapes: an order mismatch NCCL would hang on."""
    group, world = _fresh_group(), dist.get_world_size()
    big, small = torch.zeros(4 * world, device=SIM), torch.zeros(4, device=SIM)
    with pytest.raises(CollectiveMismatch) as e:
        if dist.get_rank() == 0:
            dist.all_gather_single(big, small, group=group)
        else:
            dist.reduce_scatter_single(small, big, group=group)
    assert "rank 0: all_gather_into_tensor" in str(e.value) and "rank 1: reduce_scatter_tensor" in str(e.value)


def refused_tensors() -> None:
    """What NCCL refuses, refused before any rank waits: a non-contiguous tensor, a host tensor, a wrong output
    size, different input and output dtypes."""
    group, world = _fresh_group(), dist.get_world_size()
    cases = [
        (lambda: dist.all_reduce(torch.zeros(8, device=SIM)[::2], group=group), "Tensors must be contiguous"),
        (lambda: dist.all_reduce(torch.zeros(4), group=group), "No backend type associated with device type cpu"),
        (lambda: dist.all_gather_single(torch.zeros(4 * world + 1, device=SIM), torch.zeros(4, device=SIM),
                                             group=group), "output numel"),
        (lambda: dist.reduce_scatter_single(torch.zeros(4, device=SIM),
                                            torch.zeros(4 * world, device=SIM, dtype=torch.bfloat16), group=group),
         "dtypes differ"),
        (lambda: dist.all_gather([torch.zeros(3, device=SIM) for _ in range(world)], torch.zeros(4, device=SIM),
                                 group=group), f"needs {world} outputs of numel 4"),
    ]
    for call, words in cases:
        with pytest.raises(RefusedTensor) as e:
            call()
        assert words in str(e.value) and "refused_tensors" in str(e.value), str(e.value)
    dist.all_reduce(torch.zeros(4, device=SIM), group=group)  # every rank refused the same: still in step


def matching_collectives_pass() -> None:
    group, world = _fresh_group(), dist.get_world_size()
    dist.all_gather_single(torch.zeros(4 * world, device=SIM), torch.zeros(4, device=SIM), group=group)
    dist.reduce_scatter_single(torch.zeros(4, device=SIM), torch.zeros(4 * world, device=SIM), group=group)
    dist.all_gather([torch.zeros(4, device=SIM) for _ in range(world)], torch.zeros(4, device=SIM), group=group)
    dist.barrier(group=group)


CASES = [matching_collectives_pass, skipped_collective, shape_mismatch, op_mismatch, refused_tensors]


def run_cases() -> None:
    for case in CASES:
        set_check_timeout(3.0 if case is skipped_collective else 60.0)
        case()
        dist.barrier(group=accelerator.host_group())  # the skipping rank waits here for the others' timeout
