"""Pinned host memory under cpu_offload: what lives as long as the run is pinned at its exact size
(accelerator.host_resident), not in the caching host allocator's power-of-two blocks, and the simulated GPU's
pinned-memory model (simulated/allocator.py) books each kind as CUDA would."""
from __future__ import annotations

import functools

import torch
from torch import nn

from shardtune import accelerator
from shardtune.engine.collectives import CommCounter
from shardtune.engine.flat_param import FlatParam
from shardtune.engine.reduce import GradReducer
from shardtune.engine.vocab import _add_grad
from shardtune.simulated.allocator import AllocatorTracker

MiB = 1 << 20


def test_resident_buffers_are_pinned_at_their_size(monkeypatch) -> None:
    """A 405B unit shard (760 MiB) takes 760 MiB of pinned memory, given back when it dies; a transient copy's
    buffer is a cached power-of-two block; pageable host memory (AdamW's moments) is not pinned at all."""
    from shardtune.simulated.host import host_empty as _host_empty
    from shardtune.simulated.host import is_host as _is_host

    monkeypatch.setattr(accelerator, "make_host_buffer", _host_empty)  # what plan --simulate does
    sim = accelerator.SIMULATED
    tracker = AllocatorTracker(host=_is_host).start()
    try:
        base = tracker.pinned.reserved
        shard = accelerator.host_resident(760 * MiB // 4, torch.float32, sim)
        copy = accelerator.host_empty(3 * MiB // 4, torch.float32, sim)
        assert tracker.pinned.reserved - base == 760 * MiB + 4 * MiB
        moments = shard * 2  # a host op: pageable
        assert tracker.pinned.reserved - base == 764 * MiB
        assert tracker.host_peak_bytes() >= 2 * 760 * MiB + 3 * MiB
        del shard, moments
        assert tracker.pinned.reserved - base == 4 * MiB  # unregistered and unmapped
        del copy
        assert tracker.pinned.reserved - base == 4 * MiB  # the caching allocator keeps its block
    finally:
        tracker.stop()


def test_table_gradient_copies_land_in_two_buffers() -> None:
    """The reducer's landing buffers for a flat (here a table used twice per micro-step, as a tied one is): the
    first copy of a step becomes the gradient, the second lands beside it and is added; across steps the same two
    buffers serve, and the gradient is each step's exact sum (a buffer reused while it is the gradient would not
    give it)."""
    cpu = torch.device("cpu")
    flat = FlatParam([("w", nn.Parameter(torch.zeros(6, 4)), [])], requires_grad=True, num_decay=1, shard_rank=0,
                     shard_size=1, compute_dtype=torch.float32, device=cpu, offload=True)
    flat.local = True  # a row-sharded table (engine/shard.py): its gradient is its segment's
    (_, _, _, segment), = flat.segments
    reducer = GradReducer(shard_group=None, replicate_group=None, reduce_dtype=torch.float32, device=cpu,
                          counter=CommCounter(), offload=True)
    reducer.reuse_landing = True  # an accelerator's setting (the host keeps none), here on CPU where values exist
    add = functools.partial(_add_grad, segment)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        uses = [torch.randn(24, generator=gen) for _ in range(2)]
        for g in uses:
            reducer.copy_to_host(flat, g.clone(), stream=None, add=add)
        reducer.wait()
        torch.testing.assert_close(segment.grad, uses[0] + uses[1], rtol=0, atol=0)
        segment.grad = None  # the optimizer's zero_grad(set_to_none=True)
    buffers = reducer._landing_buffers[flat]
    assert len(buffers) == 2 and reducer.pending() == 0
