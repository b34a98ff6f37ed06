"""Fused expert weights stored as NF4 (QLoRA on a mixture of experts): grouped matmuls over runs of experts, each
run dequantized into the reused tile buffer (nf4_linear.py), in forward and again in backward.

A layer's experts `[E, out, in]` are quantized as one `(E·out) x in` matrix (nf4_layout.matrix_shape), blocks along
the input dim like a Linear's (experts stored transposed, `[E, in, out]`, are quantized as their transpose): expert e
is rows [e·out, (e+1)·out), whole 64-element blocks, so a run of experts dequantizes on its own with
`dequantize_rows`. The
experts' rows of the input are sorted by expert (model/experts.py); a run's rows are contiguous, so each run is one
grouped matmul over its experts. Runs hold as many experts as `tile_bytes` of the compute dtype allow (at least one):
one run per layer when the layer's experts fit (the whole layer dequantized: c·E·a·b bytes), else several, never
more than `tile_bytes` of dequantized weight alive. The weight is frozen: backward computes only the input's
gradient, re-dequantizing each run (autograd saves the NF4 views, not a dequantized copy). The router, norms and
adapters are not here: they stay in the compute dtype.
"""
from __future__ import annotations

from typing import Any

import torch

from shardtune import accelerator
from shardtune.engine.nf4 import NF4Tensor
from shardtune.engine.nf4_linear import _buffer, block_scalers, dequantize_rows
from shardtune.model.experts import balanced_ends, grouped_mm


class Nf4Experts:
    """What an experts module's `gate_up_proj` / `down_proj` attribute holds while its unit is gathered under QLoRA."""

    def __init__(self, matrix: NF4Tensor, shape: torch.Size, *, tile_bytes: int) -> None:
        self.matrix = matrix  # (E·out, in) NF4 over views of the gathered bytes
        self.shape = shape  # (E, out, in), whatever the model's storage order
        self.dtype = matrix.dtype
        self.ndim = 3
        self.tile_bytes = tile_bytes

    def experts_per_run(self) -> int:
        per_expert = self.shape[1] * self.shape[2] * self.dtype.itemsize
        return max(1, min(self.shape[0], self.tile_bytes // per_expert if self.tile_bytes else self.shape[0]))

    def grouped_linear(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (S, in), rows sorted by expert, offsets (E,) int32 cumulative row counts -> (S, out) = x·W[e]ᵀ per
        expert, in x's dtype."""
        return _GroupedNf4.apply(x, offsets, self)


def _runs(w: Nf4Experts, offsets: torch.Tensor, rows: int):
    """(first expert, last + 1, first row, last row + 1, local offsets) of each run of experts with rows."""
    if accelerator.is_simulated(offsets.device):  # no data: the even split routed_offsets assumed
        ends = balanced_ends(rows, w.shape[0])
    else:
        ends = offsets.tolist()  # one host read per projection (a GPU sync), for the runs' row ranges
    n = w.experts_per_run()
    for e0 in range(0, w.shape[0], n):
        e1 = min(w.shape[0], e0 + n)
        r0, r1 = (ends[e0 - 1] if e0 else 0), ends[e1 - 1]
        if r1 > r0:
            yield e0, e1, r0, r1, (offsets[e0:e1] - r0).to(torch.int32)


def _dequantized(w: Nf4Experts, e0: int, e1: int, scalers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a, b = w.shape[1], w.shape[2]
    buf = _buffer(w.experts_per_run() * a * b, w.dtype, w.matrix.device)
    return dequantize_rows(w.matrix, e0 * a, e1 * a, buf, scalers).view(e1 - e0, a, b).to(dtype)


class _GroupedNf4(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: torch.Tensor, w: Nf4Experts) -> torch.Tensor:
        ctx.save_for_backward(offsets)
        ctx.w = w  # views of the gathered NF4 bytes: nothing new kept alive
        y = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
        scalers = block_scalers(w.matrix)
        for e0, e1, r0, r1, local in _runs(w, offsets, x.shape[0]):
            y[r0:r1] = grouped_mm(x[r0:r1], _dequantized(w, e0, e1, scalers, x.dtype).transpose(-2, -1), local)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        (offsets,) = ctx.saved_tensors
        w = ctx.w
        g = grad_y.contiguous()
        gx = torch.zeros(g.shape[0], w.shape[2], dtype=g.dtype, device=g.device)
        scalers = block_scalers(w.matrix)
        for e0, e1, r0, r1, local in _runs(w, offsets, g.shape[0]):
            gx[r0:r1] = grouped_mm(g[r0:r1], _dequantized(w, e0, e1, scalers, g.dtype), local)
        return gx, None, None
