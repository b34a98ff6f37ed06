"""NF4 fused experts (engine/nf4_experts.py): the grouped matmul over runs of dequantized experts equals, forward and
input gradient, a per-expert loop over torchao's dequantized weight (to_nf4 of the (E·a) x b matrix), whether one run
holds every expert or each run one expert, for both storage orders; and a unit of a QLoRA MoE stores its experts
as NF4 (the plan's layout lists them)."""
from __future__ import annotations

import pytest
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.engine.nf4 import nf4_view, quantize
from shardtune.engine.nf4_experts import Nf4Experts
from shardtune.engine.nf4_layout import BLOCK, Nf4Layout, scaler_block


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tile_bytes", [64 * 32 * 4, 1 << 20])  # one expert per run | all experts in one run
def test_grouped_nf4_equals_per_expert_loop(transposed, tile_bytes):
    torch.manual_seed(0)
    shape = (8, 64, 32)  # [E, out, in], or [E, in, out] when transposed
    w = torch.randn(shape) * 0.05
    layout = Nf4Layout.of(torch.Size(shape), torch.float32)
    buf = quantize(lambda a, m: w.reshape(-1)[a:a + m], layout, torch.device("cpu"))
    experts = Nf4Experts(nf4_view(buf, layout), torch.Size(shape), tile_bytes=tile_bytes)
    assert experts.experts_per_run() == (1 if tile_bytes < 1 << 20 else 8)
    ref_w = to_nf4(w.reshape(-1, 32), BLOCK, scaler_block(w.numel())).get_original_weight().view(shape)
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4])  # an expert with no tokens, too
    offsets = counts.cumsum(0).to(torch.int32)
    in_f = shape[1] if transposed else shape[2]
    x = torch.randn(int(counts.sum()), in_f, requires_grad=True)
    y = experts.grouped_linear(x, offsets, transposed=transposed)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    xr = x.detach().clone().requires_grad_()
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        we = ref_w[e] if transposed else ref_w[e].t()
        parts.append(xr[start:start + n] @ we)
        start += n
    yr = torch.cat(parts)
    (yr * g).sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_qlora_moe_unit_stores_experts_as_nf4():
    from tests.unit.test_moe_lora import build

    from shardtune.config.schema import LoraConfig
    from shardtune.engine.api import ShardingPolicy
    from shardtune.engine.layout import unit_layouts
    from shardtune.engine.wrap import resolve_unit_classes
    from shardtune.lora import apply_lora

    model = apply_lora(build("tiny-qwen3-moe"), LoraConfig(enabled=True, r=2, target_modules=["q_proj"]))
    policy = ShardingPolicy(unit_classes=resolve_unit_classes(model, "auto"), quantize_base=True)
    layouts = unit_layouts(model, policy, 2)
    names = {n.split(".", 3)[-1] for u in layouts for n, _ in u.quantized_weights}  # per layer, without model.layers.i
    assert names == {"self_attn.q_proj.base_layer.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}, names
    # the router (mlp.gate.weight), norms and adapters stay in the compute dtype
