"""Stateless collectives over a process group, each adding what this rank sent + received to a `CommCounter`.

Byte convention (ring algorithms, what NCCL and gloo's ring do; per rank, W ranks in the group):
- all-gather into an output of N elements of s bytes: sends (W-1)/W·N·s and receives as much -> 2(W-1)/W·N·s.
- reduce-scatter of an input of N elements: the same, 2(W-1)/W·N·s.
- all-reduce of N elements = reduce-scatter + all-gather: 4(W-1)/W·N·s.
A group of one rank moves nothing and is skipped. Counts are exact integers when N is a multiple of W (our flat
buffers are padded to one); the scalar all-reduce of grad clipping rounds down.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class CommCounter:
    bytes: int = 0  # monotonic: sent + received by this rank
    by_op: Counter = field(default_factory=Counter)  # (op, dtype) -> bytes: what tests and bench break down
    calls: Counter = field(default_factory=Counter)  # (op, dtype) -> number of collectives

    def add(self, op: str, dtype: torch.dtype, nbytes: int) -> None:
        self.bytes += nbytes
        self.by_op[op, dtype] += nbytes
        self.calls[op, dtype] += 1


def _ring_bytes(numel: int, elem_size: int, world: int) -> int:
    return 2 * (world - 1) * numel * elem_size // world


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                    *, async_op: bool = False) -> dist.Work | None:
    """out (1D, numel = W·shard.numel) <- concatenation of every rank's `shard`. Returns the work if async."""
    world = dist.get_world_size(group)
    assert out.numel() == world * shard.numel() and out.dtype == shard.dtype
    if world == 1:
        out.copy_(shard)
        return None
    counter.add("all_gather", out.dtype, _ring_bytes(out.numel(), out.element_size(), world))
    return dist.all_gather_single(out, shard, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                        *, full_is_scratch: bool = False) -> None:
    """out (1D, numel = full.numel / W) <- this rank's slice of the SUM over ranks of `full`.

    `full_is_scratch=True` lets it overwrite `full`: on gloo we then run our own ring over send/recv, in place
    (one chunk of scratch), because gloo's reduce_scatter first copies its whole input into a scratch buffer:
    +1 unit of peak memory at every reduce-scatter, the root's embeddings + head at the end of backward.
    Same bytes either way: W-1 steps, each sending and receiving one chunk of numel N/W.
    """
    world = dist.get_world_size(group)
    assert full.numel() == world * out.numel() and out.dtype == full.dtype
    if world == 1:
        out.copy_(full)
        return
    counter.add("reduce_scatter", full.dtype, _ring_bytes(full.numel(), full.element_size(), world))
    if not (full_is_scratch and dist.get_backend(group) == "gloo"):
        dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
        return
    rank = dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    chunks = full.chunk(world)  # equal: `full` is padded to a multiple of W
    for step in range(world - 1):
        # Rank r sends chunk r-k-1 (its partial sum so far) to r+1 and adds chunk r-k-2 from r-1 into its own;
        # after W-1 steps chunk r holds the full sum.
        send = dist.isend(chunks[(rank - step - 1) % world], dst=nxt, group=group)
        dist.recv(out, src=prev, group=group)
        if step < world - 2:
            chunks[(rank - step - 2) % world].add_(out)
        else:
            out.add_(chunks[rank])
        send.wait()


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, counter: CommCounter,
                *, async_op: bool = False) -> dist.Work | None:
    """In-place SUM over the group. `group=None` means a group of one rank (no-op)."""
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return None
    counter.add("all_reduce", tensor.dtype, 2 * _ring_bytes(tensor.numel(), tensor.element_size(), world))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
