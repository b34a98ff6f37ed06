"""NF4 through torchao: our chunked, byte-laid-out quantization is bit-identical to `to_nf4` of the whole weight,
whatever the chunking; the rebuilt NF4Tensor computes as torchao's; the byte layout keeps code blocks whole."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.engine import nf4
from shardtune.engine.nf4_layout import BLOCK_BYTES, Nf4Layout, quantizable, scaler_block


@pytest.mark.parametrize("shape,dtype", [((344, 128), torch.float32), ((64, 128), torch.bfloat16),
                                         ((256, 256), torch.bfloat16)])
def test_chunked_quantization_is_to_nf4(shape, dtype, monkeypatch) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    layout = Nf4Layout.of(torch.Size(shape), dtype)
    assert layout.nbytes % BLOCK_BYTES == 0
    ref = nf4.to_nf4(w.to(dtype), 64, scaler_block(w.numel()))
    for chunk in (64, 640, 1 << 20):  # many chunks, a few, one
        monkeypatch.setattr(nf4, "chunk_numel", lambda n, c=chunk: c)
        region = nf4.quantize(lambda a, m: w.reshape(-1)[a:a + m], layout, torch.device("cpu"))
        got = nf4.nf4_view(region, layout)
        assert torch.equal(got.quantized_data, ref.quantized_data)
        assert torch.equal(got.get_original_weight(), ref.get_original_weight())
    x = torch.randn(3, shape[1], dtype=dtype, requires_grad=True)
    y = F.linear(x, got)
    torch.testing.assert_close(y, F.linear(x.detach(), ref.get_original_weight()), rtol=0, atol=0)
    y.sum().backward()  # linear_nf4: an input gradient, no weight gradient
    assert x.grad is not None and x.grad.shape == x.shape


def test_scaler_block_depends_on_the_weight_only() -> None:
    assert scaler_block(8192 * 28672) == 256  # Llama-70B MLP: QLoRA's default
    assert all((n // 64) % scaler_block(n) == 0 for n in (64, 128 * 64 * 3, 8192, 44032))
    assert (8192 // 64 // scaler_block(8192)) % 8 == 0  # FSDP2 + torchao splits factors over up to 8 shards
    assert quantizable(torch.Size((128, 64))) and not quantizable(torch.Size((128,)))
    assert not quantizable(torch.Size((3, 7)))
