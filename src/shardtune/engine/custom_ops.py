"""The pieces of a decoder block that dynamo cannot trace, as torch.library custom ops: one graph node each inside a
compiled block (engine/compile.py), no graph break. Eager runs do not go through them (they call the same code
directly); a compiled run calls them where `torch.compiler.is_compiling()` (model/experts.py, engine/nf4_linear.py).

- `grouped_mm`: the experts' grouped matmul (model/experts.grouped_mm). torch's meta kernel of `F.grouped_mm` takes
  bf16 only, so fake tracing of an fp32 run fails; transformers' fallback loop reads the offsets on the host. The op
  runs the eager function itself (same kernel, same numerics); its fake says only the output's shape, (S, out): the
  routed row count S is the input's, static per run (tokens x top-k), so nothing data-dependent reaches the graph.
- `nf4_linear`, `nf4_grouped`: a frozen NF4 weight's tiled matmul (engine/nf4_linear.py) and NF4 experts' grouped
  one (engine/nf4_experts.py). Each is an autograd Function looping over tiles dequantized into one shared buffer;
  traced, the graph would save that buffer, which later tiles overwrite. The op takes the weight's plain parts
  (views of the gathered bytes, ordinary graph inputs rebound every step), rebuilds the same weight inside and runs
  the eager Function; its backward, the eager backward, computes the input's gradient only (the base is frozen).
- `document_attention`: packed rows' attention (model/attention.py), one causal SDPA per document (or varlen on a
  GPU) from host document lengths, which dynamo would specialize on (a compile per batch). The op takes them as a
  host tensor of a fixed shape (rows x seq_len, zero-padded: engine/compile.py), so one graph serves every batch.
  Its backward recomputes the attention's forward to take its vector-Jacobian product (torch.func.vjp): autograd
  does not record inside an op. Cost: one more attention forward per block backward; no attention dropout.
Every op saves for backward what the eager code saves (its inputs; the NF4 parts), never a dequantized copy.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# -- experts: grouped matmul -------------------------------------------------------------------------------------


@torch.library.custom_op("shardtune::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x (S, in), rows sorted by expert, @ w (E, in, out) per expert; offsets (E,) int32 cumulative rows."""
    from shardtune.model.experts import grouped_mm as eager

    # torch's grouped kernel may pad the output's row stride to 16 bytes: the fake says contiguous
    return eager(x, w, offsets).contiguous()


@grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("shardtune::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool,
                        need_w: bool) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_w) of `grouped_mm`, as an eager run's autograd computes them (bit for bit: the same kernel
    calls as torch's grouped_mm derivative, or transformers' fallback backward op). An unneeded one is empty."""
    from shardtune.model.experts import torch_grouped_kernel

    grad = grad.contiguous()
    if not torch_grouped_kernel(x, w):
        gx, gw = torch.ops.transformers.grouped_mm_fallback_backward(x, w, offsets, grad)
    else:
        gx = F.grouped_mm(grad, w.transpose(-2, -1), offs=offsets) if need_x else None
        gw = F.grouped_mm(x.t(), grad, offs=offsets) if need_w else None  # (E, in, out): rows of expert e
    gx = gx.contiguous() if need_x else x.new_empty(0)
    gw = gw.contiguous() if need_w else w.new_empty(0)
    return gx, gw


@grouped_mm_backward.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape) if need_x else x.new_empty(0)), (w.new_empty(w.shape) if need_w else w.new_empty(0))


def _grouped_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, w, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gx, gw = grouped_mm_backward(grad, x, w, offsets, need_x, need_w)
    return (gx if need_x else None), (gw if need_w else None), None


grouped_mm.register_autograd(_grouped_backward, setup_context=_grouped_setup)

# -- NF4 Linear --------------------------------------------------------------------------------------------------


def nf4_linear(x: Tensor, w: Any) -> Tensor:
    """F.linear(x, w) for an nf4_linear.TiledNF4Tensor `w`, as one op over its parts. (torchao's own NF4Tensor,
    engine.nf4_tile_mb=0, needs none: dynamo traces its whole-weight dequantize.)"""
    out_f, in_f = w.shape
    return _nf4_linear(x, w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4,
                       out_f, in_f, w.block_size, w.scaler_block_size, w.tile_bytes)


def _weight(codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, out_f: int, in_f: int,
            block_size: int, scaler_block: int, tile_bytes: int) -> Any:
    """The NF4 weight the eager run computes with, over the same parts (no copy): nf4.nf4_view's construction."""
    from shardtune.engine.nf4 import NF4Tensor, SubclassTensorArgs
    from shardtune.engine.nf4_linear import TiledNF4Tensor

    cls = TiledNF4Tensor if tile_bytes else NF4Tensor
    meta = SubclassTensorArgs(torch.Size((out_f, in_f)), (in_f, 1), 0, factors.dtype, codes.device, False)
    w = cls(meta, block_size, out_f * in_f // block_size, scaler_block, scalers, factors, mean, codes, levels)
    if tile_bytes:
        w.tile_bytes = tile_bytes
    return w


@torch.library.custom_op("shardtune::nf4_linear", mutates_args=())
def _nf4_linear(x: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor,
                out_f: int, in_f: int, block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    w = _weight(codes, scalers, factors, mean, levels, out_f, in_f, block_size, scaler_block, tile_bytes)
    with torch.no_grad():
        return F.linear(x, w).contiguous()


@_nf4_linear.register_fake
def _(x: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, out_f: int,
      in_f: int, block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_f)


@torch.library.custom_op("shardtune::nf4_linear_backward", mutates_args=())
def _nf4_linear_backward(grad: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor,
                         levels: Tensor, out_f: int, in_f: int, block_size: int, scaler_block: int,
                         tile_bytes: int) -> Tensor:
    """grad_x = grad_y @ W by the eager Function's own backward (tiles, or torchao's whole weight)."""
    from shardtune.engine.nf4_linear import _TiledLinear

    w = _weight(codes, scalers, factors, mean, levels, out_f, in_f, block_size, scaler_block, tile_bytes)
    with torch.no_grad():
        return _TiledLinear.backward(SimpleNamespace(saved_tensors=(w,)), grad)[0].contiguous()


@_nf4_linear_backward.register_fake
def _(grad: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, out_f: int,
      in_f: int, block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    return grad.new_empty(*grad.shape[:-1], in_f)


def _nf4_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[1:6])  # the NF4 parts: views of the gathered bytes, never the input
    ctx.meta = inputs[6:]


def _nf4_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    gx = _nf4_linear_backward(grad, *ctx.saved_tensors, *ctx.meta) if ctx.needs_input_grad[0] else None
    return (gx, *([None] * 10))


_nf4_linear.register_autograd(_nf4_backward, setup_context=_nf4_setup)

# -- NF4 experts ---------------------------------------------------------------------------------------------------


def nf4_grouped_linear(x: Tensor, offsets: Tensor, w: Any) -> Tensor:
    """nf4_experts.Nf4Experts.grouped_linear(x, offsets) as one op over the NF4 parts. Traced instead, its tiles
    would be written into the tile buffer every weight shares, which the graph saves for backward."""
    m = w.matrix
    return _nf4_grouped(x, offsets, m.quantized_data, m.quantized_scalers, m.quantization_factor, m.scaler_mean,
                        m.nf4, list(w.shape), m.block_size, m.scaler_block_size, w.tile_bytes)


def _experts(codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, shape: list[int],
             block_size: int, scaler_block: int, tile_bytes: int) -> Any:
    from shardtune.engine.nf4_experts import Nf4Experts

    e, out_f, in_f = shape
    matrix = _weight(codes, scalers, factors, mean, levels, e * out_f, in_f, block_size, scaler_block, tile_bytes)
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
    from shardtune.engine.nf4_experts import _GroupedNf4

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

# -- packed rows' attention ----------------------------------------------------------------------------------------


def document_attention(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                       window: int | None) -> Tensor:
    """model/attention.document_attention over packed rows whose documents come as `lengths` (host int64, (rows,
    seq_len): each row's document lengths, then zeros) -> [b, s, heads, d]."""
    return _document_attention(query, key, value, lengths, scaling, window)


def _eager_attention(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                     window: int | None) -> Tensor:
    from shardtune.model.attention import document_attention as eager

    docs = tuple(tuple(n for n in row if n) for row in lengths.tolist())  # a host tensor: no device sync
    extra = {} if window is None else {"sliding_window": window}
    return eager(None, query, key, value, None, scaling=scaling, doc_lengths=docs, **extra)[0]


@torch.library.custom_op("shardtune::document_attention", mutates_args=())
def _document_attention(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                        window: int | None) -> Tensor:
    return _eager_attention(query, key, value, lengths, scaling, window).contiguous()


@_document_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
      window: int | None) -> Tensor:
    b, h, s, d = query.shape
    return query.new_empty(b, s, h, d)


@torch.library.custom_op("shardtune::document_attention_backward", mutates_args=())
def _document_attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lengths: Tensor,
                                 scaling: float | None, window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: _eager_attention(q, k, v, lengths, scaling, window), query, key, value)
    return tuple(g.contiguous() for g in vjp(grad.contiguous()))


@_document_attention_backward.register_fake
def _(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
      window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.meta = inputs[4:]


def _attention_bwd(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    return (*_document_attention_backward(grad, *ctx.saved_tensors, *ctx.meta), None, None, None)


_document_attention.register_autograd(_attention_bwd, setup_context=_attention_setup)
