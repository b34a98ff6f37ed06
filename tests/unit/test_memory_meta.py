"""The memory tracker's meta mode (what `plan --simulate` counts): meta storages have sizes but no bytes; live and
peak bytes follow them exactly as the CPU mode follows host storages, frees included, and host stand-ins
(simulated/host.HostMeta) are counted apart."""
from __future__ import annotations

import torch

from shardtune.memory import CpuMemoryTracker, free_storage
from shardtune.simulated.host import HostMeta
from shardtune.simulated.host import host_empty as _host_empty
from shardtune.simulated.host import is_host as _is_host


def test_meta_mode_counts_meta_storages_and_frees() -> None:
    kept = torch.empty(1000, device="meta")  # alive before start: found by the scan
    t = CpuMemoryTracker(device_type="meta").start()
    try:
        assert t.live_bytes() >= 4000
        base = t.live_bytes()
        a = torch.empty(256, 1024, device="meta")  # 1 MiB
        b = a * 2  # another 1 MiB
        assert t.live_bytes() == base + 2 * 2**20
        free_storage(b)  # the engine's in-place free
        assert t.live_bytes() == base + 2**20
        del a
        assert t.live_bytes() == base
        assert t.peak_bytes() == base + 2 * 2**20
        cpu = torch.ones(10_000)  # host tensors are not the simulated device's
        assert t.live_bytes() == base
        del cpu
    finally:
        t.stop()
    del kept


def test_host_stand_ins_are_counted_apart() -> None:
    t = CpuMemoryTracker(device_type="meta", host=_is_host).start()
    try:
        base = t.live_bytes()
        shard = _host_empty(2**20, torch.bfloat16, torch.device("meta"))  # 2 MiB "on the host"
        assert isinstance(shard, HostMeta) and t.live_bytes() == base
        moments = torch.zeros_like(shard)  # an op on a host tensor: host too (offloaded AdamW states)
        assert isinstance(moments, HostMeta)
        assert t.host_peak_bytes() == 2 * 2 * 2**20 and t.live_bytes() == base
        sent = shard.to(torch.device("meta"), non_blocking=True)  # the engine's H2D copy: device bytes
        assert not isinstance(sent, HostMeta) and t.live_bytes() == base + 2 * 2**20
    finally:
        t.stop()
