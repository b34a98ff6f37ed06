"""The simulated GPU's allocator models (shardtune/simulated/allocator.py) against CUDA's documented rules: block
rounding and segment sizes, per-stream pools, record_stream, and the pinned pool's power-of-two blocks."""
from __future__ import annotations

from shardtune.simulated.allocator import DeviceAllocator, PinnedHostAllocator, pinned_round_threshold

MiB = 1 << 20


def test_blocks_round_to_512_bytes_and_segments_follow_the_pools():
    a = DeviceAllocator()
    a.malloc(1, 1)  # small pool: 512 B block in a 2 MiB segment
    assert (a.allocated, a.reserved) == (512, 2 * MiB)
    a.malloc(2, 1000)  # the same segment's rest
    assert (a.allocated, a.reserved) == (512 + 1024, 2 * MiB)
    a.malloc(3, 3 * MiB)  # 1-10 MiB: a 20 MiB segment, split (the rest > 1 MiB)
    assert a.reserved == 22 * MiB
    a.malloc(4, 5 * MiB)  # carved from that segment's rest: nothing new reserved
    assert a.reserved == 22 * MiB
    a.malloc(5, 12 * MiB + 1)  # > 10 MiB: its own segment, rounded up to 2 MiB
    assert a.reserved == 22 * MiB + 14 * MiB
    assert a.allocated == 512 + 1024 + 3 * MiB + 5 * MiB + 12 * MiB + 512


def test_a_freed_block_is_reused_on_its_stream_only():
    a = DeviceAllocator()
    a.malloc(1, 12 * MiB)
    a.free(1)
    a.stream = "side"
    a.malloc(2, 12 * MiB)  # another stream's pool: a new segment
    assert a.reserved == 24 * MiB
    a.stream = "compute"
    a.malloc(3, 12 * MiB)  # back on its own stream: the cached block
    assert (a.reserved, a.peak_allocated) == (24 * MiB, 24 * MiB)


def test_record_stream_holds_the_block_until_the_stream_is_waited_on():
    a = DeviceAllocator()
    a.malloc(1, 12 * MiB)
    a.on_trace(("op", "reduce", "reduce_scatter", ""))  # the reduce stream reads the block
    a.record_stream(1, "reduce")
    a.on_trace(("op", "reduce", "all_reduce", ""))
    a.free(1)
    assert a.held_back == 1
    a.malloc(2, 12 * MiB)  # nothing says the reduce stream is done: a new segment
    assert a.reserved == 24 * MiB
    a.on_trace(("wait_stream", "compute", "reduce"))  # compute waits on reduce: the block comes back
    assert a.held_back == 0
    a.malloc(3, 12 * MiB)
    assert a.reserved == 24 * MiB


def test_an_event_completes_its_stream_up_to_its_record():
    a = DeviceAllocator()
    a.malloc(1, 12 * MiB)
    a.on_trace(("op", "copy", "d2h", ""))
    a.record_stream(1, "copy")
    a.on_trace(("record", "copy", 7))
    a.free(1)
    a.on_trace(("op", "copy", "d2h", ""))  # later work on the copy stream does not matter
    a.on_trace(("host_wait", "host", 7))
    assert a.held_back == 0


def test_pinned_blocks_round_to_a_power_of_two_unless_configured():
    assert PinnedHostAllocator(threshold=None).block_size(760 * MiB) == 1024 * MiB  # 405B unit shards: +35 %
    p = PinnedHostAllocator(threshold=64 * MiB)
    assert (p.block_size(760 * MiB), p.block_size(3 * MiB)) == (760 * MiB, 4 * MiB)
    p.malloc(1, 3 * MiB)
    p.free(1)
    p.malloc(2, 4 * MiB)  # the cached 4 MiB block
    assert p.peak_reserved == 4 * MiB
    assert pinned_round_threshold("expandable_segments:True,pinned_max_round_threshold_mb:64") == 64 * MiB
    assert pinned_round_threshold("") is None


def test_the_seam_tells_the_allocator_model_what_a_side_stream_holds():
    """accelerator.record_stream on a simulated stream reaches the model: a meta tensor freed while the reduce
    stream may read it stays reserved until the compute stream waits for that stream."""
    import torch

    from shardtune import accelerator
    from shardtune.simulated.allocator import AllocatorTracker

    sim = accelerator.SIMULATED
    reduce = accelerator.new_stream(sim, "reduce")
    tracker = AllocatorTracker().start()
    # meta tensors an earlier test of this process still holds (and the segment they take)
    base, reserved0, allocated0 = tracker.live_bytes(), tracker.device.reserved, tracker.device.allocated
    try:
        grad = torch.empty(3 * MiB, dtype=torch.float32, device=sim)  # 12 MiB on the compute stream
        with accelerator.use_stream(reduce):
            accelerator.note(sim, "reduce_scatter", "unit0")
        accelerator.record_stream(grad, reduce)
        del grad
        assert tracker.device.held_back == 1 and tracker.live_bytes() == base
        kept = torch.empty(3 * MiB, dtype=torch.float32, device=sim)  # cannot take the held block: a new segment
        assert tracker.device.reserved - reserved0 == 24 * MiB and kept.is_meta
        accelerator.current_stream(sim).wait_stream(reduce)
        assert tracker.device.held_back == 0
        again = torch.empty(3 * MiB, dtype=torch.float32, device=sim)  # the held block, back in the pool
        assert tracker.device.reserved - reserved0 == 24 * MiB and again.is_meta
        assert tracker.device.allocated - allocated0 == 24 * MiB
    finally:
        tracker.stop()
