"""A MoE projection on the simulated GPU: routing, NF4 experts' forward and backward, with no host sync, on the
branch CUDA takes (issue 58, defect 1)."""
from __future__ import annotations

import torch

from shardtune.engine.nf4 import nf4_view, quantize
from shardtune.engine.nf4_experts import Nf4Experts
from shardtune.engine.nf4_layout import Nf4Layout


def test_moe_projection_reads_nothing_on_the_host():
    """The simulated GPU runs CUDA's branch (no even-split stand-in for the routing: the source asks no "is this
    simulated") and counts no host sync in a MoE projection's routing, forward and backward: CUDA's bincount reads
    the ids' maximum on the host, and runs of whole experts needed the offsets there, ~6 syncs a layer."""
    import inspect

    from shardtune import accelerator
    from shardtune.engine import nf4_experts
    from shardtune.model import experts as experts_mod
    from shardtune.model.experts import routed_offsets
    from shardtune.simulated.device import install

    for module in (experts_mod, nf4_experts):
        assert "is_simulated" not in inspect.getsource(module), module.__name__
    install()
    shape = (8, 16, 256)
    layout = Nf4Layout.of(torch.Size(shape), torch.bfloat16)
    buf = quantize(lambda a, m: torch.randn(m), layout, torch.device("cpu")).to(accelerator.SIMULATED)
    experts = Nf4Experts(nf4_view(buf, layout), torch.Size(shape), tile_bytes=4 * 16 * 256 * 2)
    assert experts.tiles() == (8, 128)  # row tiles forward, slabs backward
    accelerator.TRACE.clear()
    sorted_ids = torch.sort(torch.empty(40, dtype=torch.int64, device=accelerator.SIMULATED))[0]
    offsets = routed_offsets(sorted_ids, shape[0])
    x = torch.empty(40, shape[2], dtype=torch.bfloat16, device=accelerator.SIMULATED, requires_grad=True)
    experts.grouped_linear(x, offsets).sum().backward()
    assert x.grad.shape == x.shape
    assert accelerator.host_syncs() == []
