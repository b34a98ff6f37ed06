"""`engine.offload_activations`: the inputs that activation checkpointing keeps go to host memory while the forward
runs on, and come back just ahead of the recompute that needs them.

With checkpointing, each checkpointed unit keeps one tensor through the forward: its input (b·s·h). Non-reentrant
`torch.utils.checkpoint` saves those inputs as saved tensors before it enters its own hooks, so a
`saved_tensors_hooks` pair open around the checkpoint call sees exactly them (the ops inside the region are under
checkpoint's hooks): nothing else is offloaded, and the region's recompute is untouched.

  pack   (forward, as the unit starts): the copy stream waits for the compute stream (the input was produced
         there), a pinned host buffer receives a non-blocking D2H copy, an event marks its end. The device tensor
         is recorded on the copy stream, so the caching allocator reuses its memory only once the copy has read it.
  unpack (backward, the unit's recompute): its H2D copy was started ahead, when the next unit in backward order
         unpacked (`ahead` units back, 1 by default: the copy has that unit's whole recompute and backward, b·s·h of
         compute per b·s·h/PCIe-bandwidth of copy, to land); the compute stream waits on that copy's event, never the
         host. A tensor not fetched yet is fetched now. Each unit fetched ahead costs b·s·h of device memory at the
         backward peak (1 GiB per unit at 128k tokens on an 8B model), so one is the default.
Cost: per checkpointed unit, b·s·h bytes over PCIe each way, overlapped with the units' compute; the device keeps
only the inputs in flight (`ahead` + 1 at most in backward) instead of every unit's. Host: one pinned buffer per
unit input (the pinned allocator rounds each to a power of two). No host sync is added.
On a CPU run "host" and device are the same memory: the copies are real (the same code path) and the host buffers
are counted apart by the memory tracker (memory.host_allocations), so the measurement shows what a GPU would hold.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from shardtune import accelerator, memory


@dataclass
class _Stashed:
    host: torch.Tensor  # pinned host copy of the unit input, written on the copy stream
    offloaded: Any  # event: the D2H copy is done (None off an accelerator: copies are synchronous)
    device: torch.Tensor | None = None  # the H2D copy, once fetched
    fetched: Any = None  # event: the H2D copy is done


class ActivationOffloader:
    def __init__(self, device: torch.device, *, ahead: int = 1) -> None:
        assert ahead >= 1
        self.device = torch.device(device)
        self.ahead = ahead
        self.stream = accelerator.new_stream(self.device, "activation-offload")
        self._stash: dict[int, _Stashed] = {}  # pack order (forward order of the units) -> stashed input
        self._next = 0
        self.num_offloaded = 0  # D2H copies issued (tests)
        self.num_fetched_ahead = 0  # H2D copies issued before their unit's recompute asked (tests)

    def checkpointed(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """`forward` checkpointed (non-reentrant), with its saved inputs offloaded."""
        return functools.partial(self._run, forward)

    def _run(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    # -- hooks ---------------------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.numel() == 0:
            return t
        compute = accelerator.current_stream(self.device)
        if self.stream is not None:
            self.stream.wait_stream(compute)  # `t` is written by compute work queued before this point
        with memory.host_allocations():
            host = accelerator.host_empty(t.numel(), t.dtype, self.device).view(t.shape)
        with accelerator.use_stream(self.stream):
            accelerator.copy_to_host(host, t)
            accelerator.note(self.device, "d2h", "activation")
            done = accelerator.new_event(self.device)
            if done is not None:
                done.record(self.stream)
        accelerator.record_stream(t, self.stream)  # the allocator keeps `t` until the copy has read it
        key = self._next
        self._next += 1
        self._stash[key] = _Stashed(host, done)
        self.num_offloaded += 1
        return key

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        key = packed
        entry = self._stash.pop(key)
        if entry.device is None:
            self._fetch(entry)
        for earlier in range(key - 1, key - 1 - self.ahead, -1):  # the units whose recompute comes next
            e = self._stash.get(earlier)
            if e is not None and e.device is None:
                self._fetch(e)
                self.num_fetched_ahead += 1
        if entry.fetched is not None:
            accelerator.current_stream(self.device).wait_event(entry.fetched)
        return entry.device

    def _fetch(self, entry: _Stashed) -> None:
        # On the copy stream, after its D2H copy (same stream: in order); allocated there, so recorded on the compute
        # stream, its reader: the allocator reuses the block only after the recompute's work that reads it.
        compute = accelerator.current_stream(self.device)
        with accelerator.use_stream(self.stream):
            entry.device, entry.fetched = accelerator.copy_to_device(entry.host, self.device, copy=True,
                                                                     label="activation")
        accelerator.record_stream(entry.device, compute)
