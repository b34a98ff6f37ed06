"""Gradient reduction of the units' flat gradients: reduce-scatter into this rank's shard (and, under hybrid_shard /
no_shard, an all-reduce across replicas), issued asynchronously and waited once per backward.

Pipeline of one flat gradient (1D, compute dtype, numel P, handed over by the unit's post-accumulate-grad hook):
  issue   cast to reduce_dtype on the compute stream; CUDA: the reduce stream waits on an event recorded on the
          compute stream after the gradient was produced, and the collective is issued from it (async_op=True).
          gloo: the same call returns a work handle whose bytes move on gloo's threads.
  promote hybrid_shard: the replica all-reduce of the reduce-scatter's output. On an accelerator it is issued at
          once, on its own stream (which waits for the reduce-scatter), so it runs while the next unit computes. On
          gloo it is issued at the next `make_room` (issuing it waits for the reduce-scatter on the CPU).
  retire  the compute stream waits for the last collective, then adds the output into the sharded gradient
          (device), or the reduce stream copies it non-blocking into a pinned host buffer, records an event and the
          compute stream waits for that event (CPU offload; the host add happens in `wait`). The host buffers are
          the flat's own, pinned at their exact size and reused every step (`_landing`): the first copy of a step
          becomes the host gradient (reduce fp32), a later micro-step's lands beside it until it is added.
At most `max_in_flight` reductions are issued and not retired: each keeps its gradient (P, reduce dtype) and its
output (P/W) alive. With the default 1, the reduction of unit i overlaps the first half of unit i-1's backward
(by gradient elements) and is retired there; only then is unit i-2 gathered ahead (engine/unit.py: at most one unit
beyond the current one alive, so the backward's peak is a synchronous reduction's). The two ends run without
overlap: unit 1's reduction is retired before unit 0's backward, unit 0's right after it is issued (the deepest
points of the backward: every sharded gradient exists, then the embedding gradient). plan/estimate.py models it.
Every rank issues, promotes and retires at the same program points (never on `is_completed()`, which differs per
rank), so the collectives of each group run in the same order everywhere.

Lifetimes on CUDA: the gradient and the output are allocated on the compute stream and referenced by the pending
record until the compute stream has waited for everything that reads them (the collectives, offload's D2H copy) at
retire, so the allocator cannot hand their memory to later compute work early, and no `record_stream` is needed:
their memory returns in stream order. The cost is FSDP2's: a reduction slower than one unit's backward stalls the
compute stream at the next retire.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardtune import accelerator
from shardtune.engine.collectives import CommCounter, all_reduce_, reduce_scatter_into
from shardtune.engine.flat_param import FlatParam


@dataclass
class _Pending:
    flat: FlatParam
    full: torch.Tensor | None  # 1D, reduce dtype, numel P: the reduce-scatter input, alive until retired
    out: torch.Tensor  # 1D, reduce dtype, numel P/W (P without a shard group): this rank's summed slice
    work: Any  # the collective in flight (dist.Work or collectives' ring work), None when there is nothing to wait
    all_reduce_left: bool  # hybrid_shard: the replica all-reduce of `out` is still to be issued


class GradReducer:
    def __init__(self, *, shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None,
                 reduce_dtype: torch.dtype, device: torch.device, counter: CommCounter, offload: bool,
                 max_in_flight: int = 1) -> None:
        assert max_in_flight >= 1
        self.shard_group = shard_group  # None: a group of one rank (no_shard): nothing to scatter
        self.replicate_group = replicate_group  # None: no replica all-reduce
        self.reduce_dtype = reduce_dtype
        self.device = device
        self.counter = counter
        self.offload = offload  # reduced shards go to (pinned) host buffers; the host adds them into the shard grad
        self.max_in_flight = max_in_flight  # memory bound: each pending reduction keeps ~1 unit gradient alive
        # False: the collective NCCL runs (reduce_scatter_single) even on gloo, so CPU tests cover it.
        self.gloo_ring = True
        self.stream = accelerator.new_stream(device, "reduce")  # separate "thread" for reductions (None on cpu)
        # hybrid_shard on an accelerator: the replica all-reduces' own stream (None on cpu, or nothing to replicate)
        self.replica_stream = (accelerator.new_stream(device, "replica")
                               if replicate_group is not None and shard_group is not None else None)
        self._in_flight: deque[_Pending] = deque()
        # offload: D2H copies not added yet: (flat, host buffer, event after the copy, what adds it on the host)
        self._host: list[tuple[FlatParam, torch.Tensor, Any, Callable[[torch.Tensor], None]]] = []
        # offload: each flat's host buffers (1D, reduce dtype, numel of `out`), made once, reused every step
        self._landing_buffers: dict[FlatParam, list[torch.Tensor]] = {}
        # Keep them (pinned memory is costly to make and CUDA's cache would round it up); False on the host, where
        # nothing is pinned and a buffer per copy frees its bytes between steps.
        self.reuse_landing = accelerator.is_accelerator(device)
        self.unsharded: dict[FlatParam, torch.Tensor] = {}  # no-sync accumulation: 1D, fp32, numel P per flat
        self.num_issued = 0  # reductions issued (tests: that the async path ran)
        self.num_host_copies = 0  # offload: D2H copies issued into host buffers (tests: offload really copies)

    def _on_stream(self) -> Any:
        return accelerator.use_stream(self.stream)

    # -- per flat gradient -----------------------------------------------------------------------------------------
    def reduce(self, flat: FlatParam, grad: torch.Tensor, *, sync: bool) -> None:
        """Take ownership of `grad` (1D, compute dtype, numel P). `sync=False`: keep it unsharded on this rank
        (+4·P bytes per flat until the synced micro-step, no traffic)."""
        acc = self.unsharded.get(flat)
        if not sync:
            if acc is None:
                self.unsharded[flat] = grad.float() if grad.dtype != torch.float32 else grad
            else:
                acc.add_(grad)
            return
        if acc is not None:
            grad = self.unsharded.pop(flat).add_(grad)
        self.make_room()  # before the cast and the issue: the bound holds at every peak
        # Ours to overwrite: autograd's flat gradient (or the no-sync accumulator) is never seen by anyone else.
        full = grad.to(self.reduce_dtype)  # no copy when already in reduce_dtype
        del grad, acc
        self.num_issued += 1
        if self.stream is not None:  # the reduce stream may read `full` only after the compute stream wrote it
            ready = accelerator.new_event(self.device)
            ready.record()
            self.stream.wait_event(ready)
        out = None
        if self.shard_group is not None:  # allocated on the compute stream, like `full` (see the module docstring)
            out = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=full.device)  # 1D, P/W
        with self._on_stream():
            if out is not None:
                work = reduce_scatter_into(out, full, self.shard_group, self.counter, full_is_scratch=True,
                                           async_op=True, ring=self.gloo_ring, label=flat.label)
                item = _Pending(flat, full, out, work, self.replicate_group is not None)
            else:  # no_shard: the whole gradient is this rank's "shard"; sum it across replicas
                work = all_reduce_(full, self.replicate_group, self.counter, async_op=True, label=flat.label)
                item = _Pending(flat, None, full, work, False)
        if self.replica_stream is not None:
            self._issue_all_reduce(item)  # at once, on its own stream (hybrid on an accelerator)
        self._in_flight.append(item)

    @property
    def num_in_flight(self) -> int:
        """Collectives issued and not retired (`pending` also counts offload's host copies not yet added)."""
        return len(self._in_flight)

    def make_room(self) -> None:
        """Retire the oldest reductions until fewer than `max_in_flight` are pending. Called before a new one is
        issued and (units whose parameters are all trainable) just before autograd concatenates the next flat
        gradient, so the gradient cat, the backward's memory peak, never coexists with a full in-flight window."""
        self._promote()
        while len(self._in_flight) >= self.max_in_flight:
            self._retire(self._in_flight.popleft())

    def _promote(self) -> None:
        """Hybrid: issue the replica all-reduce of every pending reduce-scatter. Sums the new contribution only (the
        accumulated shard grad is already summed): no double count."""
        for item in self._in_flight:
            self._issue_all_reduce(item)

    def _issue_all_reduce(self, item: _Pending) -> None:
        if not item.all_reduce_left:
            return
        with accelerator.use_stream(self.replica_stream or self.stream):
            if item.work is not None:
                item.work.wait()  # CUDA: the stream waits for the reduce-scatter, the CPU goes on; gloo: blocks
            item.work = all_reduce_(item.out, self.replicate_group, self.counter, async_op=True, label=item.flat.label)
        item.all_reduce_left = False

    def _retire(self, item: _Pending) -> None:
        """The compute stream waits for the whole reduction (reduce-scatter, replica all-reduce, offload's D2H copy)
        before anything after it, as FSDP2 waits at the next post-backward: the gradient and the output are freed
        in stream order, so at most `max_in_flight` reductions' buffers are ever alive (a reduction the compute
        stream never waited for would pin them, through record_stream, for as long as its collectives lag)."""
        self._issue_all_reduce(item)
        if not self.offload:
            if item.work is not None:
                item.work.wait()  # CUDA: the compute stream waits for the collective; then it adds the result
            item.flat.accumulate_shard_grad(item.out)
            return
        self._add_earlier_copy(item.flat)
        with self._on_stream():
            if item.work is not None:
                item.work.wait()
            # Non-blocking D2H into a pinned buffer; the host reads it only after `done` (in `wait`).
            host = self._landing(item.flat, item.out)
            accelerator.copy_to_host(host, item.out)
            accelerator.note(self.device, "d2h", item.flat.label)
            done = None
            if self.stream is not None:
                done = accelerator.new_event(self.device)
                done.record(self.stream)
        if done is not None:
            accelerator.current_stream(self.device).wait_event(done)  # the copy has read `out`: both may go
        self.num_host_copies += 1
        self._host.append((item.flat, host, done, item.flat.accumulate_shard_grad))

    def _landing(self, flat: FlatParam, out: torch.Tensor) -> torch.Tensor:
        """A host buffer for the D2H copy of `out`: one of the flat's own (pinned at its exact size for the run,
        accelerator.host_resident) that is neither its live host gradient (a copy in fp32 becomes the gradient until
        the optimizer drops it) nor a copy still waiting to be added. Two at most: the gradient and a later
        micro-step's copy (plan/estimate.py counts both); a fresh pinned buffer per copy would come from the
        caching host allocator, a power of two each."""
        if not self.reuse_landing:
            return accelerator.host_empty(out.numel(), out.dtype, self.device)
        buffers = self._landing_buffers.setdefault(flat, [])
        busy = [flat.shard_grad(), *(h for f, h, _, _ in self._host if f is flat)]
        for buf in buffers:
            if not any(buf is b for b in busy):
                return buf
        buf = accelerator.host_resident(out.numel(), out.dtype, self.device)
        buffers.append(buf)
        return buf

    def copy_to_host(self, flat: FlatParam, grad: torch.Tensor, *, stream: Any,
                     add: Callable[[torch.Tensor], None]) -> None:
        """Offload: a device gradient this reducer does not reduce (a row-sharded vocabulary table's, summed by
        autograd already: engine/vocab.py) copied to the host without blocking: on `stream`, after an event on the
        current stream (where `grad` was written), into one of the flat's landing buffers; the allocator keeps
        `grad` until the copy has read it. `add(host)` runs on the host at the next `wait` (or
        `add_host_copies`), after the copy's event; the flat's earlier copy is added first (a tied table's head
        copy, issued a whole backward earlier), so two buffers per flat suffice."""
        self._add_earlier_copy(flat)
        grad = grad.reshape(-1)  # (a copy when not contiguous: then that copy is what the copy stream reads)
        host = self._landing(flat, grad)
        done = None
        if stream is not None:
            ready = accelerator.new_event(self.device)
            ready.record()
            stream.wait_event(ready)
        with accelerator.use_stream(stream):
            accelerator.copy_to_host(host, grad)
            accelerator.note(self.device, "d2h", flat.label)
            if stream is not None:
                accelerator.record_stream(grad, stream)  # `done` covers the point recorded here
                done = accelerator.new_event(self.device)
                done.record(stream)
        self.num_host_copies += 1
        self._host.append((flat, host, done, add))

    def _add_earlier_copy(self, flat: FlatParam) -> None:
        """Offload, a later micro-step: the flat's copy from the previous one (a micro-step old: done by now, so
        the event wait costs nothing) is added into its host gradient before the next copy is allocated. So at most
        one copy per flat waits on the host, not one per micro-step (grad_accum x the sharded gradients)."""
        for i, (f, host, done, add) in enumerate(self._host):
            if f is flat:
                del self._host[i]
                if done is not None:
                    done.synchronize()
                add(host)
                return

    # -- once per backward / step ------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Retire every pending reduction (CUDA: stream waits only, no CPU sync): at the end of backward, and around
        the first unit's backward (engine/unit.py)."""
        self._promote()
        while self._in_flight:
            self._retire(self._in_flight.popleft())

    def finish_backward(self) -> None:
        """End of backward: every reduction retired."""
        self.drain()

    def wait(self) -> None:
        """Before the optimizer reads gradients (clipping, step, checkpoint): every reduced gradient is in its
        shard. Offload: the CPU blocks on exactly the D2H copies' events, then adds on the host."""
        self.finish_backward()
        self.add_host_copies(lambda flat: True)

    def add_host_copies(self, which: Callable[[FlatParam], bool]) -> None:
        """Offload: add the D2H copies of the flats `which` selects on the host, each after its event (the CPU
        blocks until that copy is done)."""
        keep = []
        for flat, host, done, add in self._host:
            if not which(flat):
                keep.append((flat, host, done, add))
                continue
            if done is not None:
                done.synchronize()
            add(host)
        self._host = keep

    def abandon(self) -> None:
        """A backward raised: wait for what was issued (the buffers must outlive the collectives, and every rank
        issued the same ones), then drop it all, unsharded accumulators included: the step's gradients are lost."""
        for item in self._in_flight:
            if item.work is not None:
                item.work.wait()
        self._in_flight.clear()
        for _, _, done, _ in self._host:
            if done is not None:
                done.synchronize()
        self._host.clear()
        self.unsharded.clear()

    def pending(self) -> int:
        return len(self._in_flight) + len(self._host)
