"""The CPU live-bytes tracker: allocations, frees, in-place storage resizes, peaks."""
from __future__ import annotations

import torch

from shardtune.memory import CpuMemoryTracker, snapshot_live_bytes


def test_tracks_alloc_free_and_peak() -> None:
    tracker = CpuMemoryTracker().start()
    try:
        base = tracker.live_bytes()
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(500, dtype=torch.float64)
        assert tracker.live_bytes() - base == 4000 + 4000
        del a
        assert tracker.live_bytes() - base == 4000
        assert tracker.peak_bytes() - base == 8000
        tracker.reset_peak()
        assert tracker.peak_bytes() - base == 4000
        del b
    finally:
        tracker.stop()


def test_sees_storage_resize_outside_dispatch() -> None:
    t = torch.empty(100_000)  # 400 kB: above the recheck threshold
    tracker = CpuMemoryTracker().start()
    try:
        base = tracker.live_bytes()
        t.untyped_storage().resize_(0)  # how FSDP frees gathered params; not a dispatched op
        torch.zeros(1)  # any op: the tracker re-reads large storages at op boundaries
        assert base - tracker.live_bytes() == 400_000
        t.untyped_storage().resize_(400_000)
        torch.zeros(1)
        assert tracker.live_bytes() == base
    finally:
        tracker.stop()


def test_snapshot_counts_live_storages() -> None:
    before = snapshot_live_bytes()
    x = torch.empty(250_000)
    assert snapshot_live_bytes() - before == 1_000_000
    del x
