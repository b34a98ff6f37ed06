"""Start-up checksum speed (model/fingerprint.py): a host tensor through XXH3 against the integer-sum path that
device tensors take (forced here on the CPU), GB/s of fp32 weights, one process.

    .venv/bin/python bench/fingerprint_speed.py        # 256 MB, best of 3
"""
from __future__ import annotations

import time

import torch

from shardtune.model import fingerprint


def gbps(t: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fingerprint.checksum([t])
        best = min(best, time.perf_counter() - t0)
    return t.numel() * t.element_size() / best / 1e9


def main() -> None:
    t = torch.randn(64_000_000)
    xxh3 = gbps(t)
    fingerprint._XXH3_DEVICES = ()
    sums = gbps(t)
    print(f"torch threads {torch.get_num_threads()}: XXH3 {xxh3:.1f} GB/s, integer sums {sums:.2f} GB/s, "
          f"ratio {xxh3 / sums:.0f}x")


if __name__ == "__main__":
    main()
