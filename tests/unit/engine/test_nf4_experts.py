"""NF4 fused experts (engine/nf4_experts.py): the grouped matmul over runs of dequantized experts equals, forward and
input gradient, a per-expert loop over torchao's dequantized weight (to_nf4 of the (E·out) x in matrix), whether one
run holds every expert or each run one expert; experts stored transposed ([E, in, out], gpt-oss) are quantized with
their blocks along the input dim too (the bytes of to_nf4 of their transpose), through the loader's chunked reads and
through a unit of tiny gpt-oss; and a unit of a QLoRA MoE stores its experts as NF4 (the plan's layout lists them)."""
from __future__ import annotations

import pytest
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.engine import nf4
from shardtune.engine.nf4 import nf4_view, quantize
from shardtune.engine.nf4_experts import Nf4Experts
from shardtune.engine.nf4_layout import BLOCK, Nf4Layout, matrix_shape, scaler_block


# (shape [E, out, in], tile_bytes, (rows per forward tile, columns per backward slab)):
@pytest.mark.parametrize("shape,tile_bytes,tiles", [
    ((8, 64, 32), 1 << 20, (64, 0)),  # every expert in one tile: the whole layer at once, forward and backward
    ((8, 64, 32), 64 * 32 * 4, (8, 0)),  # a budget of one expert: row tiles; rows split blocks: fp32 sum in backward
    ((8, 64, 128), 2 * 64 * 128 * 4, (16, 64)),  # two experts' budget: row tiles; one block column at least
    ((8, 16, 256), 4 * 16 * 256 * 4, (8, 128)),  # four experts': row tiles forward, column slabs backward
])
def test_grouped_nf4_equals_per_expert_loop(shape, tile_bytes, tiles, monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    layout = Nf4Layout.of(torch.Size(shape), torch.float32)
    buf = quantize(lambda a, m: w.reshape(-1)[a:a + m], layout, torch.device("cpu"))
    experts = Nf4Experts(nf4_view(buf, layout), torch.Size(shape), tile_bytes=tile_bytes)
    assert experts.tiles() == tiles
    ref_w = to_nf4(w.reshape(-1, shape[2]), BLOCK, scaler_block(w.numel())).get_original_weight().view(shape)
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4])  # an expert with no tokens, too
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), shape[2], requires_grad=True)
    # offsets stay on the device: a host read of them is a GPU sync per projection (issue 58)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("host read of the offsets"))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("host read of the offsets"))
    y = experts.grouped_linear(x, offsets)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    monkeypatch.undo()
    xr = x.detach().clone().requires_grad_()
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        parts.append(xr[start:start + n] @ ref_w[e].t())
        start += n
    yr = torch.cat(parts)
    (yr * g).sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_transposed_experts_blocks_run_along_input_dim(monkeypatch):
    torch.manual_seed(0)
    e, fan_in, fan_out = 4, 128, 96
    w = torch.randn(e, fan_in, fan_out) * 0.05  # stored [E, in, out], as gpt-oss stores its experts
    w[:, :, 0] *= 40  # output row 0 of each expert is loud: only blocks along the input dim keep it to itself
    layout = Nf4Layout.of(w.shape, torch.float32, transposed=True)
    assert matrix_shape(layout.shape, layout.transposed) == (e * fan_out, fan_in)  # a block = 64 inputs of one row
    monkeypatch.setattr(nf4, "CHUNK", BLOCK * 4)  # chunks smaller than an expert: the loader's piecewise reads
    reads = []
    buf = quantize(lambda a, m: reads.append(m) or w.reshape(-1)[a:a + m], layout, torch.device("cpu"))
    assert max(reads) == fan_in * fan_out  # one expert at a time, never the whole weight
    ref = to_nf4(w.transpose(-2, -1).reshape(e * fan_out, fan_in), BLOCK, scaler_block(w.numel()))
    assert torch.equal(buf[layout.codes:layout.codes + w.numel() // 2], ref.quantized_data)
    assert torch.equal(buf[layout.scalers:layout.scalers + w.numel() // BLOCK].view(torch.int8), ref.quantized_scalers)
    deq = nf4.dequantize(buf, layout)  # back in the storage order
    assert deq.shape == w.shape
    torch.testing.assert_close(deq, ref.get_original_weight().view(e, fan_out, fan_in).transpose(-2, -1))
    # the quiet outputs keep their precision: blocks along the output dim would share a scaler with the loud row
    quiet = (deq - w)[:, :, 1:].abs().max() / w[:, :, 1:].abs().max()
    assert quiet < 0.3, quiet  # 0.18 along the input dim; 0.82 along the output dim


def test_gpt_oss_unit_quantizes_experts_along_input_dim():
    from tests.unit.test_moe_lora import build

    from shardtune.config.schema import LoraConfig
    from shardtune.engine.api import ShardingPolicy
    from shardtune.engine.layout import group_unit_params
    from shardtune.engine.quantized import QuantizedFlat
    from shardtune.engine.wrap import resolve_unit_classes
    from shardtune.model.experts import in_out
    from shardtune.model.lora import apply_lora

    model = apply_lora(build("tiny-gpt-oss"), LoraConfig(enabled=True, r=2, target_modules=["q_proj"]))
    policy = ShardingPolicy(unit_classes=resolve_unit_classes(model, "auto"), quantize_base=True)
    entries = [q for up in group_unit_params(model, policy) for q in up.quantized if q[1].ndim == 3]
    assert entries, "tiny gpt-oss: its experts are quantized"
    original = {name: p.detach().clone() for name, p, _ in entries}
    dims = {name: in_out(*locs[0]) for name, _, locs in entries}  # before the NF4 views replace the weights
    flat = QuantizedFlat(entries, nf4_dtype=torch.float32, shard_rank=0, shard_size=1, device=torch.device("cpu"))
    flat.alloc_full()
    flat.full.copy_(flat.shard)
    _, views = flat.bind_views(requires_grad=False)
    for slot, view in zip(flat.slots, views, strict=True):
        module, _ = slot.locations[0]
        assert module.is_transposed and slot.layout.transposed
        n, fan_in, fan_out = dims[slot.name]
        assert view.shape == (n, fan_out, fan_in) and view.matrix.shape == (n * fan_out, fan_in), slot.name
        stored = original[slot.name]
        ref = to_nf4(stored.transpose(-2, -1).reshape(-1, fan_in), BLOCK, scaler_block(stored.numel()))
        got = dict(flat.dequantized(flat.full))[slot.name]
        torch.testing.assert_close(got, ref.get_original_weight().view(n, fan_out, fan_in).transpose(-2, -1))


def test_qlora_moe_unit_stores_experts_as_nf4():
    from tests.unit.test_moe_lora import build

    from shardtune.config.schema import LoraConfig
    from shardtune.engine.api import ShardingPolicy
    from shardtune.engine.layout import unit_layouts
    from shardtune.engine.wrap import resolve_unit_classes
    from shardtune.model.lora import apply_lora

    model = apply_lora(build("tiny-qwen3-moe"), LoraConfig(enabled=True, r=2, target_modules=["q_proj"]))
    policy = ShardingPolicy(unit_classes=resolve_unit_classes(model, "auto"), quantize_base=True)
    layouts = unit_layouts(model, policy, 2)
    names = {n.split(".", 3)[-1] for u in layouts for n, _ in u.quantized_weights}  # per layer, without model.layers.i
    assert names == {"self_attn.q_proj.base_layer.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}, names
    # the router (mlp.gate.weight), norms and adapters stay in the compute dtype



def test_routed_offsets_are_the_cumulative_counts():
    from shardtune.model.experts import routed_offsets

    ids = torch.sort(torch.tensor([5, 0, 2, 2, 7, 5, 5, 0]))[0]  # experts 1, 3, 4 and 6 with no rows
    offsets = routed_offsets(ids, 8)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [2, 2, 4, 4, 4, 7, 7, 8]
