"""Replicated trainable parameters (LoRA adapters): whole on every rank, outside the flat buffers.

They are small (MBs), so sharding them would cost a collective per unit for nothing. Every rank holds the same fp32
values and steps them identically; what must be made identical is their gradient: autograd accumulates each rank's
local gradient in `p.grad`, and a synced backward sums it over all ranks (our gradient contract: SUM, see api.py)
with ONE all-reduce of one flat bucket over every adapter, issued at the end of backward (async: it overlaps the
wait for the units' last reductions, engine/step.py) and waited for before backward returns.

Accumulation across micro-steps: a hook on each parameter takes the new local gradient before autograd accumulates
it, adds it into `pending` (1D, fp32, numel = all adapters) and hands autograd zeros instead, so `p.grad` only ever
holds gradients already summed over ranks. A synced backward reduces `pending` and adds it to `p.grad`. Every rank
then computes the same sums in the same order: the replicas stay bit-identical (a "p.grad - local + sum" scheme
would not: float rounding differs per rank and the copies drift). Between unsynced micro-steps `p.grad` reads as
what has been reduced so far.
Cost: one bucket of adapter size while gradients are pending; 4(W-1)/W x adapter bytes per synced backward.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardtune.engine.collectives import CommCounter, all_reduce_


class ReplicatedParams:
    def __init__(self, params: list[tuple[str, nn.Parameter]], group: ProcessGroup | None,
                 counter: CommCounter) -> None:
        self.params = params  # (name, parameter) in named_parameters() order
        self.group = group  # None: one rank, nothing to reduce
        self.counter = counter
        self.pending: torch.Tensor | None = None  # 1D, fp32, sum of local grads not reduced yet
        self._work = None  # the all-reduce of `pending` in flight, between start_reduce and finish_reduce
        self._offsets: list[int] = []
        offset = 0
        for _, p in params:
            self._offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        if group is not None and params:
            ref = weakref.ref(self)  # weak: autograd keeps hooks on its C++ side, out of the gc's sight
            for i, (_, p) in enumerate(params):
                p.register_hook(lambda g, i=i: _add_pending(ref, i, g))

    def _add(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        if self.pending is None:
            self.pending = torch.zeros(self.numel, dtype=torch.float32, device=grad.device)
        a = self._offsets[i]
        self.pending[a:a + grad.numel()].add_(grad.reshape(-1))
        return grad.new_zeros(()).expand_as(grad)  # what autograd accumulates instead: nothing

    def start_reduce(self) -> None:
        """End of a synced backward: sum the pending local gradients over ranks (one async all-reduce)."""
        if self.group is None or not self.params:
            return
        if self.pending is None:  # no adapter gradient on this rank: still join the collective
            self.pending = torch.zeros(self.numel, dtype=torch.float32, device=self.params[0][1].device)
        self._work = all_reduce_(self.pending, self.group, self.counter, async_op=True)

    def finish_reduce(self) -> None:
        """Wait for `start_reduce`'s all-reduce (it overlapped the units' last reductions) and add it to p.grad."""
        if self.group is None or not self.params:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        for (_, p), a in zip(self.params, self._offsets, strict=True):
            reduced = self.pending[a:a + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = reduced.to(p.dtype, copy=True)
            else:
                p.grad.add_(reduced)
        self.pending = None

    def abandon(self) -> None:
        """A backward raised: wait for an all-reduce in flight (its bucket must outlive it), drop the local sums."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.pending = None

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for _, p in self.params if p.grad is not None]

    def state_bytes(self) -> int:
        return sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for _, p in self.params)


def _add_pending(ref: weakref.ref[ReplicatedParams], i: int, grad: torch.Tensor) -> torch.Tensor | None:
    owner = ref()
    return None if owner is None else owner._add(i, grad)
