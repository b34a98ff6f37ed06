"""Issue 58: the kernels a tiled NF4 Linear (engine/nf4_linear.py) issues, counted on the simulated GPU
(simulated/launches.py): a fixed cost per matmul (the block scalers: two kernels, whatever the number of blocks)
and four per tile (index cast, table lookup, scale, one GEMM written in place), none per quantization block; the
70B QLoRA recipe's plan at 2 x 896 tokens, cut to 2 layers, where it was before the launches were cut."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.engine.nf4_layout import Nf4Layout
from shardtune.engine.nf4_linear import cols_per_tile, tile_rows, tiled_view
from shardtune.plan.planner import make_plan
from shardtune.simulated.launches import LaunchCounter
from tests.simulated.shallow import shallow_config

SCALERS = 2  # per matmul: the block scalers (int8 / factor, + mean)
PER_TILE = 4  # index cast, lookup, scale, GEMM into the output's columns


def _launches(out_f: int, in_f: int, tile_bytes: int, tokens: int = 16) -> tuple[int, int, int, int]:
    """(forward launches, backward launches, row tiles, column slabs) of one bf16 NF4 Linear on the simulated GPU."""
    layout = Nf4Layout.of(torch.Size((out_f, in_f)), torch.bfloat16)
    w = tiled_view(torch.empty(layout.nbytes, dtype=torch.uint8, device="meta"), layout, tile_bytes)
    x = torch.empty(tokens, in_f, dtype=torch.bfloat16, device="meta", requires_grad=True)
    g = torch.empty(tokens, out_f, dtype=torch.bfloat16, device="meta")
    F.linear(x.detach(), w)  # the 256-entry lookup table, built once per dtype and device, before counting
    with LaunchCounter(1) as counter:
        y = F.linear(x, w)
        forward = counter.counts[0, "forward"]
        y.backward(g)
    rows = tile_rows(w, tile_bytes)
    cols = cols_per_tile(out_f, in_f, 2, tile_bytes, tokens)
    assert 0 < cols < in_f and rows < out_f  # several tiles each way
    return forward, counter.counts[0, "backward"], -(-out_f // rows), -(-in_f // cols)


@pytest.mark.parametrize("tiles", [2, 8])
def test_launches_per_tile_not_per_block(tiles: int) -> None:
    """2 and 8 tiles each way: a fixed cost plus four kernels a tile; and a weight with 4x the quantization blocks
    in tiles of 4x the bytes issues exactly as many (nothing per block)."""
    out_f, in_f = 512, 1024
    forward, backward, row_tiles, slabs = _launches(out_f, in_f, out_f * in_f * 2 // tiles)
    assert (row_tiles, slabs) == (tiles, tiles)
    assert forward == SCALERS + PER_TILE * tiles
    assert backward == SCALERS + PER_TILE * tiles
    assert _launches(2 * out_f, 2 * in_f, 4 * out_f * in_f * 2 // tiles) == (forward, backward, tiles, tiles)


def test_70b_qlora_plan_at_896_kept(tmp_path) -> None:
    """The shipped 70B QLoRA 2x24 recipe at 2 x 896 tokens, 2 layers deep: the planned peak within 2 % of the plan
    before the launches were cut (3,309,106,688 bytes: engine.mlp_chunk_tokens=256, 32 MB tiles)."""
    plan = make_plan("llama-3.1-70b-qlora-2x24gb", [shallow_config("llama-3.1-70b-qlora-2x24gb", 2, tmp_path),
                                                    "data.seq_len=896", "train.grad_accum=2"])
    peak = max(v for k, v in plan.estimate.phases.items() if k != "load")
    assert abs(peak / 3_309_106_688 - 1) <= 0.02, peak
