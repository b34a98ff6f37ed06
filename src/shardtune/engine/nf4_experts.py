"""Fused expert weights stored as NF4 (QLoRA on a mixture of experts): grouped matmuls over tiles of every expert's
weight, each tile dequantized into the reused tile buffer (nf4_linear.py), in forward and again in backward.

A layer's experts `[E, out, in]` are quantized as one `(E·out) x in` matrix (nf4_layout.matrix_shape), blocks along
the input dim like a Linear's (experts stored transposed, `[E, in, out]`, are quantized as their transpose): expert e
is rows [e·out, (e+1)·out), whole 64-element blocks. The experts' rows of the input are sorted by expert
(model/experts.py) and `offsets` (on the device) says where each expert's rows end.

The tiles cut across the experts, never between them: forward, output rows [o0, o1) of every expert (y[:, o0:o1] =
one grouped matmul over all of x's rows); backward, input columns [c0, c1) of every expert's rows (whole blocks,
grad_x[:, c0:c1], a full-length dot product each). Cutting between experts (runs of whole experts) needs each run's
rows, a read of `offsets` on the host: a GPU sync per projection, ~6 per MoE layer per micro-batch. Here no host
ever reads `offsets`. A tile holds at most what `tile_bytes` of whole experts would (`expert_tiles`, which the
plan's plan/moe.py nf4_experts_bytes reads): one tile per projection when the layer's experts fit (the whole layer
dequantized: c·E·a·b bytes), else several. The weight is frozen: backward computes only the input's gradient,
re-dequantizing each tile (autograd saves the NF4 views, not a dequantized copy). Rows that split blocks (in not a
multiple of 64, tiny test models) make the backward sum output-row tiles instead, in fp32 (as nf4_linear.py does). The router, norms and adapters are not here: they stay in the compute dtype.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from shardtune.engine.nf4 import NF4Tensor
from shardtune.engine.nf4_layout import BLOCK
from shardtune.engine.nf4_linear import _buffer, _byte_table, _gcd, block_scalers, dequantize_cols, nf4_weight
from shardtune.model.experts import grouped_mm

ROW_ALIGN = 8  # output rows per tile a multiple of 8: 16-byte rows in bf16, what torch's grouped kernel needs


class Nf4Experts:
    """What an experts module's `gate_up_proj` / `down_proj` attribute holds while its unit is gathered under QLoRA."""

    def __init__(self, matrix: NF4Tensor, shape: torch.Size, *, tile_bytes: int) -> None:
        self.matrix = matrix  # (E·out, in) NF4 over views of the gathered bytes
        self.shape = shape  # (E, out, in), whatever the model's storage order
        self.dtype = matrix.dtype
        self.ndim = 3
        self.tile_bytes = tile_bytes

    def tiles(self) -> tuple[int, int]:
        return expert_tiles(tuple(self.shape), self.dtype.itemsize, self.tile_bytes)

    def grouped_linear(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (S, in), rows sorted by expert, offsets (E,) int32 cumulative row counts (read on the device only) ->
        (S, out) = x·W[e]ᵀ per expert, in x's dtype."""
        if torch.compiler.is_compiling():  # a compiled block: the same Function as one custom op (no traced tile loop)
            return nf4_grouped_linear(x, offsets, self)
        return _GroupedNf4.apply(x, offsets, self)


def expert_tiles(shape: tuple[int, int, int], elem: int, tile_bytes: int) -> tuple[int, int]:
    """(rows, cols) of NF4 experts `shape` = (E, out, in) dequantized in `elem`-byte elements: forward tiles of
    `rows` output rows of every expert, backward slabs of `cols` input columns of every expert's rows. Both hold at
    most what `tile_bytes` of whole experts would (at least one expert; all of them when `tile_bytes` is 0): rows a
    multiple of those that hold whole blocks and of ROW_ALIGN, at least one such group; cols whole blocks, at least
    one (0 when a row is not whole blocks: the backward then sums row tiles). One tile, rows = out, when every
    expert fits."""
    e, a, b = shape
    per_expert = a * b * elem
    run = max(1, min(e, tile_bytes // per_expert if tile_bytes else e))
    if run == e:
        return a, 0
    step = max(BLOCK // _gcd(b, BLOCK), ROW_ALIGN)
    rows = min(a, max(step, run * a // e // step * step))
    cols = 0 if b % BLOCK else min(b, max(BLOCK, run * b // e // BLOCK * BLOCK))
    return rows, cols


def dequantize_expert_rows(w: Nf4Experts, o0: int, o1: int, out: torch.Tensor, scalers: torch.Tensor) -> torch.Tensor:
    """Output rows [o0, o1) of every expert -> (E, o1-o0, in) in `out` (1D, w.dtype); element for element the
    operations of nf4_linear.dequantize_rows."""
    e, a, b = w.shape
    assert o0 * b % BLOCK == 0 and (o1 * b % BLOCK == 0 or o1 == a), "tiles hold whole quantization blocks"
    n = (o1 - o0) * b
    tile = out[:e * n]
    codes = w.matrix.quantized_data.view(e, a * b // 2)[:, o0 * b // 2:o1 * b // 2].to(torch.int32)
    torch.index_select(_byte_table(w.dtype, w.matrix.device), 0, codes.reshape(-1), out=tile.view(-1, 2))
    del codes
    tile.view(e, n // BLOCK, BLOCK).mul_(scalers.view(e, a * b // BLOCK)[:, o0 * b // BLOCK:o1 * b // BLOCK, None])
    return tile.view(e, o1 - o0, b)


def _tile(w: Nf4Experts, o0: int, o1: int, scalers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    buf = _buffer(w.shape[0] * w.tiles()[0] * w.shape[2], w.dtype, w.matrix.device)
    return dequantize_expert_rows(w, o0, o1, buf, scalers).to(dtype)


def _slab(w: Nf4Experts, c0: int, c1: int, scalers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    e, a, _ = w.shape
    buf = _buffer(e * a * w.tiles()[1], w.dtype, w.matrix.device)
    return dequantize_cols(w.matrix, c0, c1, buf, scalers).view(e, a, c1 - c0).to(dtype)


class _GroupedNf4(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: torch.Tensor, w: Nf4Experts) -> torch.Tensor:
        ctx.save_for_backward(offsets)
        ctx.w = w  # views of the gathered NF4 bytes: nothing new kept alive
        a, rows = w.shape[1], w.tiles()[0]
        scalers = block_scalers(w.matrix)
        if rows == a:
            return grouped_mm(x, _tile(w, 0, a, scalers, x.dtype).transpose(-2, -1), offsets)
        y = torch.empty(x.shape[0], a, dtype=x.dtype, device=x.device)
        for o0 in range(0, a, rows):
            o1 = min(a, o0 + rows)
            y[:, o0:o1] = grouped_mm(x, _tile(w, o0, o1, scalers, x.dtype).transpose(-2, -1), offsets)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        (offsets,) = ctx.saved_tensors
        w = ctx.w
        _, a, b = w.shape
        g = grad_y.contiguous()
        scalers = block_scalers(w.matrix)
        rows, cols = w.tiles()
        if rows == a:
            return grouped_mm(g, _tile(w, 0, a, scalers, g.dtype), offsets), None, None
        if cols:  # column slabs: each writes its own columns of grad_x
            gx = torch.empty(g.shape[0], b, dtype=g.dtype, device=g.device)
            for c0 in range(0, b, cols):
                c1 = min(b, c0 + cols)
                gx[:, c0:c1] = grouped_mm(g, _slab(w, c0, c1, scalers, g.dtype), offsets)
            return gx, None, None
        # Rows that split blocks: a sum over output-row tiles, accumulated in fp32 (each tile's product rounded
        # once to the compute dtype), so a bf16 run sees about the one rounding of a single matmul.
        acc = torch.zeros(g.shape[0], b, dtype=torch.float32, device=g.device)
        for o0 in range(0, a, rows):
            o1 = min(a, o0 + rows)
            acc += grouped_mm(g[:, o0:o1].contiguous(), _tile(w, o0, o1, scalers, g.dtype), offsets)
        return acc.to(g.dtype), None, None


# -- the compiled form: torch.library custom ops over the NF4 parts (engine/compile.py) ---------------------


def nf4_grouped_linear(x: Tensor, offsets: Tensor, w: Any) -> Tensor:
    """Nf4Experts.grouped_linear(x, offsets) as one op over the NF4 parts. Traced instead, its tiles
    would be written into the tile buffer every weight shares, which the graph saves for backward."""
    m = w.matrix
    return _nf4_grouped(x, offsets, m.quantized_data, m.quantized_scalers, m.quantization_factor, m.scaler_mean,
                        m.nf4, list(w.shape), m.block_size, m.scaler_block_size, w.tile_bytes)


def _experts(codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, shape: list[int],
             block_size: int, scaler_block: int, tile_bytes: int) -> Any:
    e, out_f, in_f = shape
    matrix = nf4_weight(codes, scalers, factors, mean, levels, e * out_f, in_f, block_size, scaler_block, tile_bytes)
    return Nf4Experts(matrix, torch.Size(shape), tile_bytes=tile_bytes)


@torch.library.custom_op("shardtune::nf4_grouped", mutates_args=())
def _nf4_grouped(x: Tensor, offsets: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor,
                 levels: Tensor, shape: list[int], block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    w = _experts(codes, scalers, factors, mean, levels, shape, block_size, scaler_block, tile_bytes)
    with torch.no_grad():
        return w.grouped_linear(x, offsets).contiguous()


@_nf4_grouped.register_fake
def _(x: Tensor, offsets: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor,
      shape: list[int], block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    return x.new_empty(x.shape[0], shape[1])


@torch.library.custom_op("shardtune::nf4_grouped_backward", mutates_args=())
def _nf4_grouped_backward(grad: Tensor, offsets: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor,
                          mean: Tensor, levels: Tensor, shape: list[int], block_size: int, scaler_block: int,
                          tile_bytes: int) -> Tensor:
    w = _experts(codes, scalers, factors, mean, levels, shape, block_size, scaler_block, tile_bytes)
    with torch.no_grad():
        return _GroupedNf4.backward(SimpleNamespace(saved_tensors=(offsets,), w=w), grad)[0].contiguous()


@_nf4_grouped_backward.register_fake
def _(grad: Tensor, offsets: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor,
      levels: Tensor, shape: list[int], block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    return grad.new_empty(grad.shape[0], shape[2])


def _nf4_grouped_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[1:7])  # offsets and the NF4 parts (views of the gathered bytes), never the input
    ctx.meta = inputs[7:]


def _nf4_grouped_bwd(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    gx = _nf4_grouped_backward(grad, *ctx.saved_tensors, *ctx.meta) if ctx.needs_input_grad[0] else None
    return (gx, *([None] * 10))


_nf4_grouped.register_autograd(_nf4_grouped_bwd, setup_context=_nf4_grouped_setup)
