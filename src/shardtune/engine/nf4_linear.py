"""A Linear over a frozen NF4 weight, computed in tiles of output rows: no full dequantized weight is ever alive.

torchao's `linear_nf4` dequantizes the whole weight per matmul, in forward and again in backward, through
`get_original_weight`: two int64 nibble-index tensors (8 B/weight), the looked-up and scaled halves and the stacked
result, ~14 B per weight at its peak in bf16 (3.1 GiB for one 8192x28672 weight). A frozen weight needs no gradient,
so the matmuls split over row tiles W[t] (whole 64-element quantization blocks):

  forward   y[:, t] = x @ W[t]^T          backward  grad_x[:, k] = grad_y @ W[:, k]

and only one tile is dequantized at a time, into a buffer reused by every tile and every weight. The backward
takes column slabs W[:, k] (whole blocks of every row, when a row is whole blocks): each slab writes its own
columns of grad_x, a full-length dot product each, so there is no sum over tiles to hold (row tiles would need an
fp32 accumulator of grad_x's size: 0.11 GiB for a 70B down_proj at 1024 tokens) and grad_x is rounded once, as
in the untiled matmul. Row tiles with that accumulator remain for weights whose rows split blocks. Dequantizing a
tile: a 65,536-entry table maps each pair of code bytes, read as one little-endian uint16, to its four NF4 levels
(in the weight's dtype), `index_select` with an int32 index writes them straight into the buffer (1 B/weight of
index, half of a byte table's), then each 64-element block is multiplied by its scaler in place. The same elementwise operations as torchao's (a level times its block's
dequantized scaler, in the weight's dtype), so each tile is bit-identical to the rows of `get_original_weight()`.

`TiledNF4Tensor` is torchao's `NF4Tensor` with `F.linear` routed here; autograd saves it (views of the gathered
bytes: no copy) and its block scalers (c/64 B/weight, so the backward does not compute them again), never the
input. The tile buffer is the only dequantized storage, its size set by bytes.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from shardtune.engine.nf4 import NF4Tensor, SubclassTensorArgs, codebook, nf4_view
from shardtune.engine.nf4_layout import BLOCK, Nf4Layout

_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # the reused tile buffer, per dtype/device


class TiledNF4Tensor(NF4Tensor):
    """An NF4Tensor whose `F.linear` dequantizes row tiles of at most `tile_bytes` (set after construction)."""

    tile_bytes: int = 64 << 20

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.linear:
            x, w, *rest = args
            bias = rest[0] if rest else (kwargs or {}).get("bias")
            if isinstance(w, TiledNF4Tensor) and not isinstance(x, NF4Tensor):
                # a compiled block (engine/compile.py): the same Function as one custom op, one node of its graph
                y = nf4_linear_op(x, w) if torch.compiler.is_compiling() else _TiledLinear.apply(x, w)
                return y if bias is None else y + bias
        return super().__torch_function__(func, types, args, kwargs)

    # A compiled block's graph takes the weight as an input (its parts, flattened): rebuilt as this class, with its
    # tile size, so the runtime's input matches the traced one (torchao's unflatten makes an NF4Tensor)
    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        names, meta = super().__tensor_flatten__()
        return names, {**meta, "tile_bytes": self.tile_bytes}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> TiledNF4Tensor:
        w = TiledNF4Tensor(meta["tensor_meta"], meta["block_size"], meta["n_blocks"], meta["scaler_block_size"],
                           inner["quantized_scalers"], inner["quantization_factor"], inner["scaler_mean"],
                           inner["quantized_data"], inner["nf4"])
        w.tile_bytes = meta["tile_bytes"]
        return w


def tiled_view(buf: torch.Tensor, layout: Nf4Layout, tile_bytes: int) -> TiledNF4Tensor:
    """nf4.nf4_view's weight over `buf`, whose matmuls dequantize tiles of at most `tile_bytes`."""
    w = nf4_view(buf, layout, cls=TiledNF4Tensor)
    w.tile_bytes = tile_bytes
    return w


def tile_rows(w: NF4Tensor, tile_bytes: int) -> int:
    return rows_per_tile(w.shape[0], w.shape[1], w.dtype.itemsize, tile_bytes)


def rows_per_tile(out_f: int, in_f: int, elem: int, tile_bytes: int) -> int:
    """Rows per tile: as many as fit in `tile_bytes`, a multiple of the rows that hold whole 64-element blocks
    (at least one such group, whatever `tile_bytes` says)."""
    align = BLOCK // _gcd(in_f, BLOCK)
    rows = max(align, tile_bytes // max(1, in_f * elem) // align * align)
    return min(rows, out_f)


def cols_per_tile(out_f: int, in_f: int, elem: int, tile_bytes: int, tokens: int = 0) -> int:
    """Columns per backward slab: whole 64-element blocks of every row, as many as fit in `tile_bytes`, and (given
    `tokens`) few enough that the slab's product, tokens x cols, fits in it too (at 128k tokens a 64 MB slab of an
    8B down_proj would make a 2 GiB product); 0 when a row is not whole blocks, or one block column of every row is
    more than `tile_bytes` (the backward then sums row tiles)."""
    if in_f % BLOCK or out_f * BLOCK * elem > tile_bytes:
        return 0
    return min(in_f, max(BLOCK, tile_bytes // max(1, out_f * elem, tokens * elem) // BLOCK * BLOCK))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        _BUFFERS.pop(key, None)  # the old one is freed before the larger one exists
        buf = _BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


def release_buffers() -> None:
    """Drop the tile buffers (tests; after training)."""
    _BUFFERS.clear()


_PAIRS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): code byte -> (level of its high nibble, level of its low nibble), torchao's element order."""
    key = (dtype, torch.device(device))
    if key not in _PAIRS:
        nf4 = codebook(dtype, device)
        b = torch.arange(256, device=device)
        _PAIRS[key] = torch.stack([nf4[b >> 4], nf4[b & 15]], dim=1).contiguous()
    return _PAIRS[key]


_WORDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
# The word table reads two code bytes as one uint16 in the device's byte order: little-endian on every CPU and GPU
# torch runs on here; a big-endian host would swap each pair's levels.
assert sys.byteorder == "little"


def _word_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(65536, 4): two code bytes b0 b1 (in memory order), read as the uint16 b0 + 256·b1 -> their four levels,
    b0's two then b1's (torchao's element order). One lookup per 4 weights: its int32 index is 1 B per weight."""
    key = (dtype, torch.device(device))
    if key not in _WORDS:
        pairs = _byte_table(dtype, device)
        v = torch.arange(1 << 16, device=device)
        _WORDS[key] = torch.cat([pairs[v & 255], pairs[v >> 8]], dim=1).contiguous()
    return _WORDS[key]


def block_scalers(w: NF4Tensor) -> torch.Tensor:
    """Every 64-element block's scaler, as torchao's dequantize_scalers: int8 / the factor of its scaler block, in
    the weight's dtype, + the mean. 1D, numel/64 (c/64 bytes per weight): computed once per matmul, sliced per tile
    (a tile then costs a handful of kernels, not a dozen)."""
    # Two kernels: the factors broadcast over their scaler blocks (scaler_block divides the block count), not
    # repeated into a copy first; the same elementwise division and sum as torchao's
    sb = w.scaler_block_size
    q = w.quantized_scalers.view(-1, sb)
    return (q / w.quantization_factor.view(-1, 1)).view(-1).to(w.dtype) + w.scaler_mean


LOOKUP_FLOOR = 64 << 20  # bytes of int32 index one lookup may take, whatever the tile size


def lookup_words(tile_bytes: int) -> int:
    """Most code words (two code bytes, four weights) one table lookup indexes in a tile of `tile_bytes`: its int32
    index (1 B/weight, half the tile's bytes in bf16) at most a quarter of the tile, or LOOKUP_FLOOR. A large tile
    (a whole 70B MLP weight: 448 MiB in bf16) is looked up in pieces, two kernels each (cast, lookup), so that its
    index adds a quarter to the tile, not a half, where one more tile would cost four kernels (and a GEMM of half
    the size); a tile whose index is under LOOKUP_FLOOR takes one lookup."""
    return max(tile_bytes // 4, LOOKUP_FLOOR) // 4


def _lookup(words: torch.Tensor, out: torch.Tensor, table: torch.Tensor, step: int) -> None:
    """out[i] = table[words[i]] for (n, k) code words (uint16) into (n·k, 4) `out`, `step` words at a time (whole
    rows of `words`): one int32 index piece alive at a time."""
    rows = max(1, step // max(1, words.shape[1]))
    for r in range(0, words.shape[0], rows):
        index = words[r:r + rows].to(torch.int32)
        k = index.numel()
        torch.index_select(table, 0, index.view(-1), out=out[r * words.shape[1]:r * words.shape[1] + k])
        del index


def dequantize_rows(w: NF4Tensor, r0: int, r1: int, out: torch.Tensor,
                    scalers: torch.Tensor | None = None, words: int = 0) -> torch.Tensor:
    """Rows [r0, r1) of the weight into `out` (1D, >= (r1-r0)*in elements, w.dtype); returns the (rows, in) view.
    `scalers`: `block_scalers(w)`, when the caller dequantizes several tiles; `words`: most code words per lookup
    (`lookup_words`; 0: one lookup)."""
    in_f = w.shape[1]
    e0, e1 = r0 * in_f, r1 * in_f
    assert e0 % BLOCK == 0 and e1 % BLOCK == 0, "tiles hold whole quantization blocks"
    b0, b1 = e0 // BLOCK, e1 // BLOCK
    tile = out[:e1 - e0]
    codes = w.quantized_data[e0 // 2:e1 // 2].view(torch.uint16)
    _lookup(codes.view(1, -1) if not words or words >= codes.numel() else codes.view(-1, BLOCK // 4),
            tile.view(-1, 4), _word_table(w.dtype, w.device), words or codes.numel())
    scalers = block_scalers(w) if scalers is None else scalers
    tile.view(b1 - b0, BLOCK).mul_(scalers[b0:b1, None])
    return tile.view(r1 - r0, in_f)


def dequantize_cols(w: NF4Tensor, c0: int, c1: int, out: torch.Tensor,
                    scalers: torch.Tensor | None = None, words: int = 0) -> torch.Tensor:
    """Columns [c0, c1) of every row (block-aligned, rows of whole blocks) into `out` (1D, >= out_f*(c1-c0)
    elements, w.dtype); returns the (out_f, c1-c0) view. Element for element the operations of `dequantize_rows`."""
    out_f, in_f = w.shape
    assert in_f % BLOCK == 0 and c0 % BLOCK == 0 and (c1 % BLOCK == 0 or c1 == in_f), "slabs of whole blocks"
    width = c1 - c0
    tile = out[:out_f * width]
    codes = w.quantized_data.view(out_f, in_f // 2)[:, c0 // 2:c1 // 2].view(torch.uint16)  # (out_f, width/4)
    _lookup(codes, tile.view(-1, 4), _word_table(w.dtype, w.device), words or codes.numel())
    scalers = block_scalers(w) if scalers is None else scalers
    tile.view(out_f, width // BLOCK, BLOCK).mul_(scalers.view(out_f, in_f // BLOCK)[:, c0 // BLOCK:c1 // BLOCK, None])
    return tile.view(out_f, width)


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: TiledNF4Tensor) -> torch.Tensor:
        out_f, in_f = w.shape
        # torchao computes in the input's dtype (the weight cast to it): so do the tiles
        x2 = x.reshape(-1, in_f)
        # Allocated in the output's shape and returned as is: a view returned from a Function cannot be written in
        # place afterwards (chunked_lora.LoraDelta adds the adapter branch into the base's output).
        out = torch.empty(*x.shape[:-1], out_f, dtype=x.dtype, device=x.device)
        y = out.view(-1, out_f)
        rows = tile_rows(w, w.tile_bytes)
        buf = _buffer(rows * in_f, w.dtype, w.device)
        scalers = block_scalers(w)
        # w: views of the gathered NF4 bytes (nothing new kept alive); its scalers (c/64 B/weight): two kernels the
        # backward need not run again
        ctx.save_for_backward(w, scalers)
        for r0 in range(0, out_f, rows):
            r1 = min(out_f, r0 + rows)
            wt = dequantize_rows(w, r0, r1, buf, scalers, lookup_words(w.tile_bytes)).to(x.dtype)
            # straight into the tile's output columns: a GEMM writes a strided result (leading dimension out_f)
            # in place, so a tile costs its dequantization and one matmul, no product to copy
            torch.mm(x2, wt.t(), out=y[:, r0:r1])
        return out

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        w, *saved = ctx.saved_tensors  # the scalers, unless a caller hands the weight alone (nf4_linear_op)
        scalers = saved[0] if saved else block_scalers(w)
        out_f, in_f = w.shape
        g2 = grad_y.reshape(-1, out_f)
        rows = tile_rows(w, w.tile_bytes)
        buf = _buffer(rows * in_f, w.dtype, w.device)
        if rows >= out_f:
            gx = g2 @ dequantize_rows(w, 0, out_f, buf, scalers, lookup_words(w.tile_bytes)).to(grad_y.dtype)
            return gx.view(*grad_y.shape[:-1], in_f), None
        cols = cols_per_tile(out_f, in_f, w.dtype.itemsize, w.tile_bytes, g2.shape[0])
        if cols:  # column slabs: each writes its own columns of grad_x
            buf = _buffer(out_f * cols, w.dtype, w.device)
            gx = torch.empty(g2.shape[0], in_f, dtype=grad_y.dtype, device=grad_y.device)
            for c0 in range(0, in_f, cols):
                c1 = min(in_f, c0 + cols)
                slab = dequantize_cols(w, c0, c1, buf, scalers, lookup_words(w.tile_bytes))
                torch.mm(g2, slab.to(grad_y.dtype), out=gx[:, c0:c1])
            return gx.view(*grad_y.shape[:-1], in_f), None
        # Rows that split blocks: a sum over row tiles: accumulated in fp32 (each tile's product rounded once to the compute dtype), so a bf16
        # run sees about the one rounding of torchao's single matmul, not one per tile. N x in x 4 bytes.
        acc = torch.zeros(g2.shape[0], in_f, dtype=torch.float32, device=grad_y.device)
        for r0 in range(0, out_f, rows):
            r1 = min(out_f, r0 + rows)
            wt = dequantize_rows(w, r0, r1, buf, scalers, lookup_words(w.tile_bytes))
            acc.add_(g2[:, r0:r1] @ wt.to(grad_y.dtype))
        return acc.to(grad_y.dtype).view(*grad_y.shape[:-1], in_f), None


# -- the compiled form: torch.library custom ops over the weight's plain parts (engine/compile.py) ------------


def nf4_linear_op(x: Tensor, w: Any) -> Tensor:
    """F.linear(x, w) for a TiledNF4Tensor `w`, as one op over its parts. (torchao's own NF4Tensor,
    engine.nf4_tile_mb=0, needs none: dynamo traces its whole-weight dequantize.)"""
    out_f, in_f = w.shape
    return _nf4_linear(x, w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4,
                       out_f, in_f, w.block_size, w.scaler_block_size, w.tile_bytes)


def nf4_weight(codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor, out_f: int, in_f: int,
            block_size: int, scaler_block: int, tile_bytes: int) -> Any:
    """The NF4 weight the eager run computes with, over the same parts (no copy): nf4.nf4_view's construction."""
    cls = TiledNF4Tensor if tile_bytes else NF4Tensor
    meta = SubclassTensorArgs(torch.Size((out_f, in_f)), (in_f, 1), 0, factors.dtype, codes.device, False)
    w = cls(meta, block_size, out_f * in_f // block_size, scaler_block, scalers, factors, mean, codes, levels)
    if tile_bytes:
        w.tile_bytes = tile_bytes
    return w


@torch.library.custom_op("shardtune::nf4_linear", mutates_args=())
def _nf4_linear(x: Tensor, codes: Tensor, scalers: Tensor, factors: Tensor, mean: Tensor, levels: Tensor,
                out_f: int, in_f: int, block_size: int, scaler_block: int, tile_bytes: int) -> Tensor:
    w = nf4_weight(codes, scalers, factors, mean, levels, out_f, in_f, block_size, scaler_block, tile_bytes)
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
    w = nf4_weight(codes, scalers, factors, mean, levels, out_f, in_f, block_size, scaler_block, tile_bytes)
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
