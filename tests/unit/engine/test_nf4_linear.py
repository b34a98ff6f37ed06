"""The tiled NF4 linear (engine/nf4_linear.py) against torchao's whole-weight linear_nf4: tiles bit-identical to
get_original_weight's rows, outputs and input gradients equal, and no full dequantized weight ever alive (bytes)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.engine.nf4 import quantize
from shardtune.engine.nf4_layout import BLOCK, Nf4Layout, scaler_block
from shardtune.engine.nf4_linear import (
    TiledNF4Tensor,
    block_scalers,
    cols_per_tile,
    dequantize_cols,
    dequantize_rows,
    lookup_words,
    release_buffers,
    tile_rows,
    tiled_view,
)
from shardtune.memory import CpuMemoryTracker


def _weights(shape, dtype, tile_bytes):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype) * 0.05
    layout = Nf4Layout.of(w.shape, dtype)
    buf = quantize(lambda a, m: w.reshape(-1)[a:a + m], layout, torch.device("cpu"))
    tiled = tiled_view(buf, layout, tile_bytes)
    assert isinstance(tiled, TiledNF4Tensor)
    return tiled, to_nf4(w, BLOCK, scaler_block(w.numel()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(344, 128), (128, 344), (96, 256)])  # 344 inputs: a tile needs 8 rows for blocks
def test_tiles_equal_torchao(shape, dtype):
    tiled, ref = _weights(shape, dtype, tile_bytes=3000)
    full = ref.get_original_weight()
    rows = tile_rows(tiled, tiled.tile_bytes)
    assert rows < shape[0] and rows * shape[1] % BLOCK == 0
    buf = torch.empty(rows * shape[1], dtype=dtype)
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        assert torch.equal(dequantize_rows(tiled, r0, r1, buf), full[r0:r1])
    x = torch.randn(3, 5, shape[1], dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = F.linear(x, tiled), F.linear(x2, ref)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_slabs_equal_torchao(dtype):
    """The backward's column slabs: bit-identical to get_original_weight's columns (the last slab narrower), and
    grad_x equal to torchao's single matmul: each column a full-length dot product, no sum over tiles."""
    out_f, in_f = 96, 320
    tiled, ref = _weights((out_f, in_f), dtype, tile_bytes=out_f * 128 * dtype.itemsize)
    cols = cols_per_tile(out_f, in_f, dtype.itemsize, tiled.tile_bytes)
    assert cols == 128 and tile_rows(tiled, tiled.tile_bytes) < out_f  # 3 slabs: 128, 128, 64 columns
    full = ref.get_original_weight()
    buf = torch.empty(out_f * cols, dtype=dtype)
    for c0 in range(0, in_f, cols):
        c1 = min(in_f, c0 + cols)
        assert torch.equal(dequantize_cols(tiled, c0, c1, buf), full[:, c0:c1])
    x = torch.randn(4, in_f, dtype=dtype, requires_grad=True)
    g = torch.randn(4, out_f, dtype=dtype)
    F.linear(x, tiled).backward(g)
    torch.testing.assert_close(x.grad, g @ full.to(dtype), rtol=1e-5, atol=1e-6)  # the same matmul, per column


@pytest.mark.parametrize("cols", [False, True])
def test_lookup_index_is_one_byte_per_weight(cols):
    """A tile's table lookup reads two code bytes per index (the 65,536-entry table): its int32 index is 1 B per
    weight, half of what one index per code byte takes; the tile is bit-identical to torchao's all the same."""
    out_f, in_f = 256, 1024
    tiled, ref = _weights((out_f, in_f), torch.bfloat16, tile_bytes=1 << 30)
    buf = torch.empty(out_f * in_f, dtype=torch.bfloat16)
    scalers = block_scalers(tiled)
    full = ref.get_original_weight()
    (dequantize_cols(tiled, 0, in_f, buf, scalers) if cols else dequantize_rows(tiled, 0, out_f, buf, scalers))
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    tile = (dequantize_cols(tiled, 64, 640, buf, scalers) if cols else dequantize_rows(tiled, 0, out_f, buf, scalers))
    peak = tracker.peak_bytes() - base
    tracker.stop()
    assert torch.equal(tile, full[:, 64:640] if cols else full)
    weights = tile.numel()
    assert weights <= peak <= weights + 4096, (peak, weights)


@pytest.mark.parametrize("cols", [False, True])
def test_lookup_in_pieces(cols):
    """A tile looked up in pieces of `words` code words: bit-identical, and only one piece's index (4 B per word)
    alive at a time. lookup_words: a quarter of the tile's bytes of index, at least LOOKUP_FLOOR's."""
    out_f, in_f, words = 256, 1024, 2048
    tiled, ref = _weights((out_f, in_f), torch.bfloat16, tile_bytes=1 << 30)
    buf = torch.empty(out_f * in_f, dtype=torch.bfloat16)
    scalers = block_scalers(tiled)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    tile = (dequantize_cols(tiled, 64, 640, buf, scalers, words) if cols
            else dequantize_rows(tiled, 0, out_f, buf, scalers, words))
    peak = tracker.peak_bytes() - base
    tracker.stop()
    full = ref.get_original_weight()
    assert torch.equal(tile, full[:, 64:640] if cols else full)
    assert 4 * words // 2 < peak <= 4 * words + 4096, peak  # cols: whole rows of 144 words, 14 rows a piece
    assert lookup_words(448 << 20) * 4 == 112 << 20 and lookup_words(32 << 20) * 4 == 64 << 20


def test_column_slabs_hold_no_accumulator():
    """Backward of a 256x4096 bf16 weight with 64 KiB slabs: grad_x is written slab by slab, so the peak has no
    fp32 accumulator of grad_x's size (what row tiles need: n x in x 4 bytes) and no full dequantized weight."""
    out_f, in_f, n = 256, 4096, 64
    tile = 64 << 10
    tiled, _ = _weights((out_f, in_f), torch.bfloat16, tile_bytes=tile)
    assert cols_per_tile(out_f, in_f, 2, tile) == 128
    release_buffers()
    x = torch.randn(n, in_f, dtype=torch.bfloat16, requires_grad=True)
    y = F.linear(x, tiled)
    g = torch.randn_like(y)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    y.backward(g)
    peak = tracker.peak_bytes() - base
    tracker.stop()
    grad_x = n * in_f * 2  # the result (and x.grad, the same tensor)
    # one slab's product and its int32 code index; the block scalers while they are built (fp32 factors and
    # quotient, then the bf16 result: 10 B per 64 weights)
    slab = n * 128 * 2 + out_f * 128 * 2 + out_f * in_f // 64 * 10
    assert peak <= grad_x + tile + slab + 4096, (peak, grad_x)
    assert peak < grad_x + n * in_f * 4  # the row tiles' fp32 accumulator alone would exceed it


def test_no_full_weight_alive():
    """Peak during forward + backward of one 1024x512 bf16 weight with 64 KiB tiles: the output/input tensors, one
    tile and its int32 index, a few block scalers; never the 1 MiB dequantized weight torchao builds (14 B/weight)."""
    out_f, in_f, n = 1024, 512, 16
    tiled, ref = _weights((out_f, in_f), torch.bfloat16, tile_bytes=64 << 10)
    release_buffers()
    x = torch.randn(n, in_f, dtype=torch.bfloat16, requires_grad=True)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    F.linear(x, tiled).sum().backward()
    peak = tracker.peak_bytes() - base
    tracker.stop()
    tile = 64 << 10
    io = n * out_f * 2 * 3 + n * in_f * 2 * 2  # y, its grad (+ one tile's output copy), grad_x and x.grad
    assert peak <= io + 2 * tile + tile // 8, (peak, io)
    assert peak < out_f * in_f * 2  # less than one full dequantized weight (torchao's path: 14x that)
