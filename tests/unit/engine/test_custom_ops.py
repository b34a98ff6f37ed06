"""The torch.library custom ops a compiled block calls where dynamo cannot trace (model/experts.py grouped_mm_op, the
tiled NF4 matmuls of engine/nf4_linear.py and nf4_experts.py; each op lives beside the eager code it runs) pass torch.library.opcheck, compute what the eager code computes (values and gradients, bit for
bit) and trace into one graph that a freshly gathered weight (new views, new objects, every step) does not recompile.
The trainer-level parity (2 ranks, 4 steps, inductor) is tests/distributed/test_compile.py."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from shardtune.engine.nf4 import quantize
from shardtune.engine.nf4_experts import Nf4Experts
from shardtune.engine.nf4_layout import Nf4Layout
from shardtune.engine.nf4_linear import tiled_view
from shardtune.model.experts import grouped_mm, grouped_mm_op

OFFSETS = torch.tensor([3, 3, 8, 12], dtype=torch.int32)  # 4 experts, one routed no row


@pytest.mark.parametrize("dims", [(64, 32), (6, 10)])  # torch's grouped kernel; transformers' fallback (unaligned)
def test_grouped_mm_op_is_the_eager_grouped_mm(dims):
    torch.manual_seed(0)
    x = torch.randn(12, dims[0], requires_grad=True)
    w = torch.randn(4, dims[0], dims[1], requires_grad=True)
    torch.library.opcheck(grouped_mm_op, (x, w, OFFSETS))
    g = torch.randn(12, dims[1])
    eager = grouped_mm(x, w, OFFSETS)
    ours = grouped_mm_op(x, w, OFFSETS)
    assert torch.equal(eager, ours)
    for a, b in zip(torch.autograd.grad(eager, (x, w), g), torch.autograd.grad(ours, (x, w), g), strict=True):
        assert torch.equal(a, b)


def _region(shape):
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.05
    layout = Nf4Layout.of(w.shape, torch.float32)
    return quantize(lambda a, m: w.reshape(-1)[a:a + m], layout, torch.device("cpu")), layout


def _compiled_equals_eager(call, bind, in_features):
    """`call(x)` eager and compiled (fullgraph) over 3 freshly bound weights: equal outputs and input gradients, one
    graph (a recompile per gather would count 3)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(call, fullgraph=True, dynamic=False, backend="aot_eager")
    for step in range(3):
        bind()
        x = torch.randn(2, 6, in_features, generator=torch.Generator().manual_seed(step), requires_grad=True)
        y0, y1 = call(x), compiled(x)
        g = torch.ones_like(y0)
        assert torch.equal(y0, y1), step
        assert torch.equal(torch.autograd.grad(y0, x, g)[0], torch.autograd.grad(y1, x, g)[0]), step
    assert torch.compiler.is_compiling() is False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("shape", [(64, 344), (96, 128)])  # rows that split blocks (fp32 sum over row tiles); whole
def test_tiled_nf4_linear_compiles_to_one_graph_equal_to_eager(shape):
    region, layout = _region(shape)
    holder = {}

    def bind():  # what quantized.bind_views does after each gather: a new weight over (re)gathered bytes
        holder["w"] = tiled_view(region.clone(), layout, tile_bytes=shape[1] * 4 * 8)  # several row tiles

    _compiled_equals_eager(lambda x: F.linear(x, holder["w"]).tanh(), bind, shape[1])


@pytest.mark.parametrize("tile_bytes", [0, 8 * 64 * 4 * 2])  # all experts at once; tiles of 2 experts' bytes
def test_nf4_experts_compile_to_one_graph_equal_to_eager(tile_bytes):
    shape = (4, 32, 64)  # (E, out, in)
    region, layout = _region(shape)
    holder = {}

    def bind():
        holder["w"] = Nf4Experts(tiled_view(region.clone(), layout, tile_bytes or 1 << 20), layout.quantized_shape,
                                 tile_bytes=tile_bytes)

    _compiled_equals_eager(lambda x: holder["w"].grouped_linear(x.view(-1, 64), OFFSETS).tanh(), bind, 64)


@pytest.mark.parametrize("window", [None, 3])  # plain causal per document; a sliding window's band
def test_packed_rows_attention_compiles_to_one_graph_equal_to_eager(window):
    """Two batches of different document layouts: one graph (the lengths are a tensor input, not guarded on)."""
    from shardtune.engine.compile import _lengths_tensor
    from shardtune.model.attention import document_attention

    extra = {} if window is None else {"sliding_window": window}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda q, k, v, t: document_attention(None, q, k, v, None, doc_lengths=t, **extra)[0],
                             fullgraph=True, dynamic=False, backend="aot_eager")
    for step, docs in enumerate((((3, 5), (8,)), ((1, 2, 5), (6, 2)))):
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(2, h, 8, 4, generator=g, requires_grad=True) for h in (4, 2, 2))  # GQA
        eager = document_attention(None, q, k, v, None, doc_lengths=docs, **extra)[0]
        ours = compiled(q, k, v, _lengths_tensor(docs))
        grad = torch.randn(eager.shape, generator=g)
        assert torch.allclose(eager, ours, atol=1e-6), step
        for a, b in zip(torch.autograd.grad(eager, (q, k, v), grad), torch.autograd.grad(ours, (q, k, v), grad),
                        strict=True):
            assert torch.allclose(a, b, atol=1e-6), step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
