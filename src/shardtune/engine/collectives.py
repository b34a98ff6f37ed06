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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardtune import accelerator


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


def _one_rank(op: str, out: torch.Tensor, src: torch.Tensor, world: int, counter: CommCounter, numel: int) -> bool:
    """A group of one rank moves nothing: `out` <- `src`, True. Otherwise counts the ring's bytes over `numel`
    elements (the unsharded side), False."""
    if world == 1:
        out.copy_(src)
        return True
    counter.add(op, src.dtype, _ring_bytes(numel, src.element_size(), world))
    return False


def _issued(op: str, tensor: torch.Tensor, label: str, work: Any) -> Any:
    """Record the collective on the simulated GPU (on the stream it was issued from) and wrap its work."""
    accelerator.note(tensor.device, op, label)
    return accelerator.tracked(work, tensor.device, f"{op}:{label}")


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                    *, async_op: bool = False, label: str = "") -> dist.Work | None:
    """out (1D, numel = W·shard.numel) <- concatenation of every rank's `shard`. Returns the work if async."""
    world = dist.get_world_size(group)
    assert out.numel() == world * shard.numel() and out.dtype == shard.dtype
    if _one_rank("all_gather", out, shard, world, counter, out.numel()):
        return None
    return _issued("all_gather", out, label, dist.all_gather_single(out, shard, group=group, async_op=async_op))


def all_to_all_into(out: torch.Tensor, send: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                    *, label: str = "") -> None:
    """out (1D) <- chunk r of every rank's `send` (1D, W equal chunks), in rank order. Blocking."""
    world = dist.get_world_size(group)
    assert out.numel() == send.numel() and out.numel() % world == 0 and out.dtype == send.dtype
    if _one_rank("all_to_all", out, send, world, counter, out.numel()):
        return
    _issued("all_to_all", out, label, dist.all_to_all_single(out, send, group=group))


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                        *, full_is_scratch: bool = False, async_op: bool = False, ring: bool = True,
                        label: str = "") -> Any:
    """out (1D, numel = full.numel / W) <- this rank's slice of the SUM over ranks of `full`. With `async_op`
    returns a handle to `wait()` on (None when nothing is in flight); `out` and `full` must stay alive until then.

    `full_is_scratch=True` lets it overwrite `full`: on gloo we then run our own ring over send/recv, in place
    (one chunk of scratch), because gloo's reduce_scatter first copies its whole input into a scratch buffer:
    +1 unit of peak memory at every reduce-scatter, the root's embeddings + head at the end of backward.
    Same bytes either way: W-1 steps, each sending and receiving one chunk of numel N/W.
    `ring=False` takes the generic `reduce_scatter_single` (what NCCL runs) even on gloo: tests cover it on CPU.
    """
    world = dist.get_world_size(group)
    assert full.numel() == world * out.numel() and out.dtype == full.dtype
    if _one_rank("reduce_scatter", out, full, world, counter, full.numel()):
        return None
    if not (ring and full_is_scratch and dist.get_backend(group) == "gloo"):
        return _issued("reduce_scatter", out, label,
                       dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op))
    work = _RingReduceScatter(out, full, group)
    if not async_op:
        work.wait()
        return None
    return work


class _RingReduceScatter:
    """Our in-place gloo ring as an async collective. Step k: rank r sends chunk r-k-1 (its partial sum so far) to
    r+1 and adds chunk r-k-2 received from r-1 into its own; after W-1 steps chunk r holds the full sum. Each step's
    send and receive are posted without blocking (gloo moves the bytes on its own threads); the adds need the CPU,
    so `wait()` runs them and posts the next step. With 2 ranks the whole transfer overlaps until `wait()`."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor, group: ProcessGroup) -> None:
        self._out, self._group = out, group
        self._world, self._rank = dist.get_world_size(group), dist.get_rank(group)
        self._next = dist.get_global_rank(group, (self._rank + 1) % self._world)
        self._prev = dist.get_global_rank(group, (self._rank - 1) % self._world)
        self._chunks = full.chunk(self._world)  # equal: `full` is padded to a multiple of W
        self._step = 0
        self._post()

    def _post(self) -> None:
        k, r, w = self._step, self._rank, self._world
        self._send = dist.isend(self._chunks[(r - k - 1) % w], dst=self._next, group=self._group)
        self._recv = dist.irecv(self._out, src=self._prev, group=self._group)

    def wait(self) -> bool:
        r, w = self._rank, self._world
        while self._step < w - 1:
            self._recv.wait()
            if self._step < w - 2:
                self._chunks[(r - self._step - 2) % w].add_(self._out)
            else:
                self._out.add_(self._chunks[r])
            self._send.wait()
            self._step += 1
            if self._step < w - 1:
                self._post()
        return True


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, counter: CommCounter,
                *, async_op: bool = False, label: str = "") -> dist.Work | None:
    """In-place SUM over the group. `group=None` means a group of one rank (no-op)."""
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return None
    counter.add("all_reduce", tensor.dtype, 2 * _ring_bytes(tensor.numel(), tensor.element_size(), world))
    return _issued("all_reduce", tensor, label,
                   dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op))


class GatherSequence(torch.autograd.Function):
    """[b, heads, n, d] on each of N ranks -> [b, heads, N·n, d], the ranks' pieces in rank order (the keys and
    values of engine.context_parallel, model/context_parallel.py). Backward: the gradient's pieces summed over the
    ranks in `reduce_dtype` (engine.reduce_dtype, as every gradient sum), each rank keeping its own
    (reduce-scatter), then cast back to the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, counter: CommCounter,
                reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.counter, ctx.shape, ctx.reduce_dtype = group, counter, x.shape, reduce_dtype
        world = dist.get_world_size(group)
        out = x.new_empty((world, *x.shape))
        all_gather_into(out.view(-1), x.contiguous().view(-1), group, counter, label="context_parallel")
        b, h, n, d = x.shape
        return out.permute(1, 2, 0, 3, 4).reshape(b, h, world * n, d)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        b, h, n, d = ctx.shape
        world = dist.get_world_size(ctx.group)
        full = grad.new_empty((world, b, h, n, d), dtype=ctx.reduce_dtype)  # one copy: rank-major, in that dtype
        full.copy_(grad.reshape(b, h, world, n, d).permute(2, 0, 1, 3, 4))
        out = full.new_empty(ctx.shape)
        reduce_scatter_into(out.view(-1), full.view(-1), ctx.group, ctx.counter, full_is_scratch=True,
                            label="context_parallel")
        return out.to(grad.dtype), None, None, None
