"""The fused chunked head + cross-entropy (shardtune/engine/loss.py) vs today's full-logits path: time and peak live bytes
of one forward + backward of the head and the loss, per chunk size (CPU, one thread).

    .venv/bin/python bench/loss_chunk.py                  # N=4096 tokens, H=256, V=32000 (~1 min)
    .venv/bin/python bench/loss_chunk.py --vocab 128256   # a Llama-3 vocabulary (slower)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from shardtune.engine.loss import linear_cross_entropy
from shardtune.memory import CpuMemoryTracker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", type=int, nargs="*", default=[256, 1024, 4096])
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,))

    def full() -> torch.Tensor:
        return F.cross_entropy((h @ w.t()).float(), t, reduction="sum")

    runs = [("full logits (chunk 0)", full)]
    runs += [(f"chunk {c}", lambda c=c: linear_cross_entropy(h, w, t, chunk_tokens=c)) for c in args.chunks]
    print(f"N={args.tokens} H={args.hidden} V={args.vocab}, fp32, forward + backward, median of 3\n")
    print("| path | ms | peak MB |\n|---|---:|---:|")
    for name, fn in runs:
        fn().backward()  # warm-up
        times = []
        tracker = CpuMemoryTracker().start()
        base = tracker.live_bytes()
        for _ in range(3):
            h.grad = w.grad = None
            t0 = time.perf_counter()
            fn().backward()
            times.append(time.perf_counter() - t0)
        peak = tracker.peak_bytes() - base
        tracker.stop()
        print(f"| {name} | {sorted(times)[1] * 1e3:.0f} | {peak / 1e6:.0f} |")


if __name__ == "__main__":
    main()
