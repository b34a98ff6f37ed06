"""AdamW on the host (what a CPU run and CPU offload step with): torch's per-tensor loop vs foreach vs fused.

    .venv/bin/python bench/host_adamw.py                 # 31 M fp32 params as one rank's shards of 2, ~1 min
    .venv/bin/python bench/host_adamw.py --params 8e6    # quicker

One process, no communication: the optimizer step is rank-local. The shards are flat fp32 tensors, as the engine
hands them to the optimizer (one decay and one no-decay flat per unit). The three optimizers step in turn, order
rotated every round, so the machine's load hits all equally; the figure is the median step time over the rounds,
as a ratio to the loop. Also checks that all three end on the same weights (fused reorders float operations:
allclose, not equal).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

KINDS = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=31e6, help="parameters of the whole model (fp32)")
    p.add_argument("--world", type=int, default=2, help="ranks: each steps 1/world of the parameters")
    p.add_argument("--units", type=int, default=8, help="units (two flat tensors each)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's share of the cores)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    per_flat = int(a.params / a.world / (2 * a.units))
    sizes = [per_flat * 99 // 100, per_flat // 100] * a.units  # decay (matrices) and no-decay (norms) flats
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    params, opts = {}, {}
    for kind, flags in KINDS.items():
        params[kind] = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [{"params": params[kind][0::2], "weight_decay": 0.1}, {"params": params[kind][1::2],
                                                                         "weight_decay": 0.0}]
        opts[kind] = torch.optim.AdamW(groups, lr=1e-3, **flags)
        for q, g in zip(params[kind], grads, strict=True):
            q.grad = g.clone()
        opts[kind].step()  # states allocated outside the timed rounds
    times = {k: [] for k in KINDS}
    order = list(KINDS)
    for r in range(a.rounds):
        for kind in order[r % 3:] + order[: r % 3]:
            t0 = time.perf_counter()
            opts[kind].step()
            times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(sizes)
    print(f"host AdamW, {n / 1e6:.1f} M fp32 params on this rank ({a.params / 1e6:.0f} M / {a.world} ranks), "
          f"{a.threads} thread(s), median of {a.rounds} steps")
    for kind in KINDS:
        same = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(params[kind], params["loop"], strict=True))
        print(f"  {kind:8s} {med[kind] * 1e3:8.1f} ms   {med[kind] / med['loop']:.2f}x loop   "
              f"weights {'match' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
