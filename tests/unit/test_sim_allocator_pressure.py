"""The simulated caching allocator under pressure (shardtune/simulated/allocator.py), as c10's malloc with default
settings: a segment that would exceed the device's memory makes it wait for every recorded stream and give back
each cached segment that is wholly free, then try again; only what still does not fit is an out-of-memory."""
from __future__ import annotations

from shardtune.simulated.allocator import DeviceAllocator

MiB = 1 << 20


def test_without_pressure_cached_segments_stay_reserved():
    a = DeviceAllocator(limit=100 * MiB)
    a.malloc(1, 30 * MiB)
    a.free(1)
    a.malloc(2, 40 * MiB)  # does not fit the cached 30 MiB block: a new segment, the old one kept
    assert (a.reserved, a.alloc_retries) == (70 * MiB, 0)


def test_a_full_device_frees_its_cached_segments_and_retries():
    a = DeviceAllocator(limit=100 * MiB)
    a.malloc(1, 30 * MiB)
    a.malloc(2, 30 * MiB)
    a.free(1)
    a.malloc(3, 50 * MiB)  # 60 + 50 > 100: the free 30 MiB segment goes back, then 30 + 50 fits
    assert (a.reserved, a.allocated, a.alloc_retries, a.ooms) == (80 * MiB, 80 * MiB, 1, 0)
    a.free(2)
    a.malloc(4, 30 * MiB)  # the cached segment of key 2 is reused: no retry
    assert (a.reserved, a.alloc_retries) == (80 * MiB, 1)


def test_a_split_segment_is_not_given_back():
    a = DeviceAllocator(limit=30 * MiB)
    a.malloc(1, 3 * MiB)  # a 20 MiB segment, split: one block in use, the rest cached
    a.malloc(2, 18 * MiB)  # larger than the cached 17 MiB rest; 20 + 18 > 30, nothing wholly free to give back
    assert (a.reserved, a.alloc_retries, a.ooms) == (38 * MiB, 1, 1)


def test_pressure_waits_for_blocks_held_by_recorded_streams():
    a = DeviceAllocator(limit=40 * MiB)
    a.malloc(1, 20 * MiB)
    a.on_trace(("op", "reduce", "reduce_scatter", ""))
    a.record_stream(1, "reduce")
    a.free(1)
    assert a.held_back == 1
    a.stream = "side"  # another stream's pool: the held block could not serve it anyway
    a.malloc(2, 30 * MiB)  # 20 + 30 > 40: synchronize (the reduce stream's work completes), free, retry
    assert (a.held_back, a.reserved, a.ooms) == (0, 30 * MiB, 0)


def test_no_limit_never_releases():
    a = DeviceAllocator()
    for k in range(4):
        a.malloc(k, 30 * MiB)
        a.free(k)
        a.stream = f"s{k}"
    assert (a.reserved, a.alloc_retries) == (120 * MiB, 0)
