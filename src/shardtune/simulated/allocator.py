"""CUDA's two allocators, modelled for the simulated GPU: what `torch.cuda.memory_reserved` / `max_memory_allocated`
and the pinned host pool would report for the same sequence of allocations, frees, streams and `record_stream`s.

Device (c10's CUDACachingAllocator, default settings):
  - every request is rounded up to a multiple of 512 bytes;
  - requests of at most 1 MiB come from the small pool, carved out of 2 MiB segments; requests up to 10 MiB from
    20 MiB segments; larger ones get a segment of their own, rounded up to 2 MiB;
  - a free block is reused by the smallest cached block that fits, of the same pool AND the same stream (the stream
    current at the allocation); a bigger block is split when the rest is >= 512 bytes (small pool) or > 1 MiB
    (large pool); neighbours in a segment merge when both are free. Segments are kept cached (no `empty_cache`)
    while the device has room;
  - under pressure (a new segment would take reserved past the device's memory, `limit`) CUDA's malloc retries
    as c10's does with its default settings: it waits for every outstanding `record_stream` event, gives every
    cached segment that is wholly free back to the device (cudaFree), and tries again. A request that still does
    not fit is an out-of-memory error on a GPU: counted (`ooms`), and the segment is made anyway so that the step
    goes on.
  - `record_stream(t, s)`: t's block returns to its pool only once every recorded stream has passed the point it was
    recorded at.

When does a simulated stream pass a point? The simulated GPU runs nothing, so the order is defined here, from the
schedule the engine issued (accelerator.TRACE), pessimistically, as a CPU far ahead of the GPU sees it: stream S's
work up to point P is complete once the host waited for it (a device sync, or `event.synchronize()` on an event
recorded on S at or after P), or once another stream waited for it (`wait_stream(S)` or `wait_event` on such an
event): work issued after that wait is ordered after P, which is what reusing the block needs. A point of a
stream is the number of schedule entries issued on it so far.

Pinned host: what `accelerator.host_empty` takes comes from ATen's CachingHostAllocator: each block is rounded up
to a power of two unless it is larger than `pinned_max_round_threshold_mb` (torch's allocator settings); freed
blocks are cached by size and reused, never returned. What `accelerator.host_resident` takes (offloaded shards, the
landing buffers of offloaded gradients) is page-locked in place at its exact size and given back when freed.
Pageable host memory (AdamW's moments on the host, host sums) is not pinned: only the tracker's host bytes count it.

AdamW over offloaded states: CUDA steps them with the fused CPU kernel, in place (accelerator.optimizer_flags); the
simulated host's meta stand-ins have no fused kernel, so their step takes the multi-tensor path, whose temporaries
(a sqrt of every second moment at once) a GPU run never holds: the tracker leaves out the host storages made inside
such a step.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from shardtune import accelerator
from shardtune.memory import CpuMemoryTracker

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest small-pool request
SMALL_BUFFER = 2 << 20  # small-pool segment
MIN_LARGE_ALLOC = 10 << 20  # below: a 20 MiB segment
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    stream: str
    small: bool
    free: bool = True
    pending: dict[str, int] = field(default_factory=dict)  # recorded stream -> point it must pass


class DeviceAllocator:
    """The caching allocator's books: `malloc(key, nbytes)`, `free(key)`, `record_stream(key, stream)`, and the
    schedule's events (`on_trace`) that complete streams."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # bytes the device can give to segments (None: unlimited, nothing is ever released)
        self.alloc_retries = self.ooms = 0  # as torch.cuda.memory_stats' num_alloc_retries, num_ooms
        self._segments: list[list[Block]] = []  # each sorted by offset, covering its segment; [] once released
        self._free: dict[tuple[bool, str], list[tuple[int, int, int]]] = {}  # (small, stream) -> (size, seg, off)
        self._blocks: dict[tuple[int, int], Block] = {}  # (segment, offset) -> block
        self._live: dict[int, Block] = {}  # key -> its block
        self._whole_free: set[int] = set()  # segments that are one free block: what pressure can give back
        self._waiting: list[Block] = []  # freed, held by recorded streams
        self._point: dict[str, int] = {}  # stream -> entries issued on it
        self._done: dict[str, int] = {}  # stream -> point known complete
        self._events: dict[object, tuple[str, int]] = {}  # event id -> (stream, point at record)
        self.stream = "compute"  # the stream current at the next malloc (set by the caller)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    # -- the pools -------------------------------------------------------------------------------------------------
    def malloc(self, key: int, nbytes: int) -> None:
        if key in self._live:
            self.free(key)
        self._process_events()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free.setdefault((small, self.stream), [])
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = self._blocks[seg, off]
            self._whole_free.discard(seg)
        else:
            seg_bytes = segment_size(size)
            if self.limit is not None and self.reserved + seg_bytes > self.limit:
                self.alloc_retries += 1
                self._release_cached()
                self.ooms += self.reserved + seg_bytes > self.limit
            seg = len(self._segments)
            block = Block(seg, 0, seg_bytes, self.stream, small)
            self._segments.append([block])
            self._blocks[seg, 0] = block
            self.reserved += seg_bytes
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = Block(block.segment, block.offset + size, rest, block.stream, small)
            block.size = size
            segment = self._segments[block.segment]
            segment.insert(segment.index(block) + 1, tail)
            self._blocks[tail.segment, tail.offset] = tail
            bisect.insort(pool, (tail.size, tail.segment, tail.offset))
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        if any(self._done.get(s, 0) < p for s, p in block.pending.items()):
            self._waiting.append(block)  # CUDA: an event per recorded stream, queried at the next malloc
        else:
            self._release(block)

    def record_stream(self, key: int, stream: str) -> None:
        block = self._live.get(key)
        if block is not None and stream != block.stream:
            block.pending[stream] = max(block.pending.get(stream, 0), self._point.get(stream, 0))

    def _release(self, block: Block) -> None:
        block.free, block.pending = True, {}
        segment = self._segments[block.segment]
        i = segment.index(block)
        pool = self._free[block.small, block.stream]
        for j in (i + 1, i - 1):  # merge with free neighbours (the later one first: indexes stay valid)
            if 0 <= j < len(segment) and segment[j].free and segment[j] is not block:
                other = segment[j]
                pool.remove((other.size, other.segment, other.offset))
                del self._blocks[other.segment, other.offset]
                if other.offset < block.offset:
                    del self._blocks[block.segment, block.offset]
                    block.offset = other.offset
                    self._blocks[block.segment, block.offset] = block
                block.size += other.size
                segment.remove(other)
        bisect.insort(pool, (block.size, block.segment, block.offset))
        if len(segment) == 1:
            self._whole_free.add(block.segment)

    def _release_cached(self) -> None:
        """c10's release_cached_blocks: synchronize on every pending event (the recorded streams' work is then
        complete), then cudaFree each cached segment that is one free block."""
        self._done.update(self._point)
        self._process_events()
        for seg in sorted(self._whole_free):
            block = self._segments[seg][0]
            self._free[block.small, block.stream].remove((block.size, block.segment, block.offset))
            del self._blocks[block.segment, block.offset]
            self._segments[seg] = []
            self.reserved -= block.size
        self._whole_free.clear()

    def _process_events(self) -> None:
        still = []
        for block in self._waiting:
            if all(self._done.get(s, 0) >= p for s, p in block.pending.items()):
                self._release(block)
            else:
                still.append(block)
        self._waiting = still

    # -- the schedule: streams' points and what completes them ----------------------------------------------------
    def on_trace(self, entry: tuple) -> None:
        kind, stream = entry[0], entry[1]
        if kind == "host_wait" and entry[2] == "all":
            self._done.update(self._point)
        elif kind == "host_wait" or kind == "wait_event":
            ev = self._events.get(entry[2])
            if ev is not None:
                self._done[ev[0]] = max(self._done.get(ev[0], 0), ev[1])
        elif kind == "wait_stream":
            self._done[entry[2]] = max(self._done.get(entry[2], 0), self._point.get(entry[2], 0))
        elif kind == "record":
            self._events[entry[2]] = (stream, self._point.get(stream, 0))
        elif kind == "record_stream":
            self.record_stream(entry[2], stream)
        if kind != "host_wait":
            self._point[stream] = self._point.get(stream, 0) + 1
        if kind in ("host_wait", "wait_event", "wait_stream"):
            self._process_events()

    @property
    def held_back(self) -> int:
        """Freed blocks not yet back in a pool: a recorded stream has not passed its point."""
        return len(self._waiting)


def pinned_round_threshold(settings: str | None = None) -> int | None:
    """Bytes above which the pinned host allocator stops rounding to a power of two (None: it always rounds).
    `settings`: torch's allocator settings string (default: the process's, where the product sets them)."""
    if settings is None:
        get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        settings = get() if get is not None else ""
    for item in settings.split(","):
        name, _, value = item.partition(":")
        if name.strip() == "pinned_max_round_threshold_mb" and value.strip():
            return int(float(value)) << 20
    return None


class PinnedHostAllocator:
    """The caching pool's power-of-two blocks (below the configured threshold), cached by size after their free;
    and exact blocks (`malloc(..., exact=True)`: registered in place), returned at their free."""

    def __init__(self, threshold: int | None = None) -> None:
        self._threshold = threshold if threshold is not None else pinned_round_threshold()
        self._live: dict[int, int] = {}  # key -> block bytes
        self._exact: set[int] = set()  # keys of live exact blocks
        self._cached: dict[int, int] = {}  # block bytes -> free blocks of that size
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def block_size(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        if self._threshold is not None and nbytes > self._threshold:
            return nbytes
        return 1 << (nbytes - 1).bit_length()

    def malloc(self, key: int, nbytes: int, *, exact: bool = False) -> None:
        if key in self._live:
            self.free(key)
        size = nbytes if exact else self.block_size(nbytes)
        if not exact and self._cached.get(size):
            self._cached[size] -= 1
        else:
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        if exact:
            self._exact.add(key)
        self._live[key] = size
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        size = self._live.pop(key, None)
        if size is None:
            return
        self.allocated -= size
        if key in self._exact:
            self._exact.discard(key)
            self.reserved -= size  # unregistered and unmapped
        else:
            self._cached[size] = self._cached.get(size, 0) + 1


class AllocatorTracker(CpuMemoryTracker):
    """The meta-device memory tracker (memory.py) feeding both allocator models: each device storage's bytes go to
    the caching allocator on the stream current at its creation, each pinned host storage's to the pinned pool (as
    the seam made it: accelerator.pinned_kind). Its own peaks (`peak_bytes`, `host_peak_bytes`) stay the live
    tensor bytes the plan predicts; `device` and `pinned` hold what the allocators would have reserved;
    `device_limit`: the simulated GPU's memory for segments."""

    def __init__(self, *, device_limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(device_type="meta", **kwargs)
        self.device = DeviceAllocator(device_limit)
        self.pinned = PinnedHostAllocator()
        self._pinned_kinds: dict[int, str | None] = {}  # host storage key -> how it is pinned (None: pageable)
        self._host_step = False  # inside an optimizer step over offloaded (simulated host) states only
        self._step_hooks: list[Any] = []

    def _update_locked(self, st: torch.UntypedStorage, host: bool | None = None) -> None:
        if id(st) not in self._sizes:  # first sight: while the seam makes it, or (at start) from its record
            if self._host_step and (host if host is not None else self._host_pred is not None and self._host_pred(None)):
                return  # the fused CPU kernel's temporaries: none (module docstring)
            self._pinned_kinds[id(st)] = accelerator.pinned_kind(st)
        super()._update_locked(st, host)

    def _step_begins(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._host_step = bool(params) and all(
            p.is_meta and accelerator.pinned_kind(p.untyped_storage()) == "exact" for p in params)

    def _step_ends(self, *_: Any) -> None:
        self._host_step = False

    def _forget(self, key: int) -> None:
        super()._forget(key)
        self._pinned_kinds.pop(key, None)

    def _add(self, key: int, delta: int) -> None:
        super()._add(key, delta)
        new = self._sizes.get(key, 0)
        if key in self._host:
            kind = self._pinned_kinds.get(key)
            if kind is None:
                return  # pageable
            if new:
                self.pinned.malloc(key, new, exact=kind == "exact")
            else:
                self.pinned.free(key)
            return
        self.device.stream = accelerator.current_stream(accelerator.SIMULATED).name
        if new:
            self.device.malloc(key, new)
        else:
            self.device.free(key)

    def start(self) -> AllocatorTracker:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        accelerator.TRACE.listeners.append(self.device.on_trace)
        self._step_hooks = [register_optimizer_step_pre_hook(self._step_begins),
                            register_optimizer_step_post_hook(self._step_ends)]
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        for hook in self._step_hooks:
            hook.remove()
        accelerator.TRACE.listeners.remove(self.device.on_trace)
