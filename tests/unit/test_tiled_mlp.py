"""engine.mlp_chunk_tokens (model/tiled_mlp.py): the same loss and gradients as the whole-sequence MLP (fp32, 1e-5), with
and without activation checkpointing, and the MLP's b·s·i intermediate never created whole."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.config.schema import ModelConfig
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.wrap import find_units
from shardtune.model.build import build_model
from shardtune.model.tiled_mlp import apply_mlp_chunking
from tests.unit.bytes_written import BytesCreated

SEQ, CHUNK, INTERMEDIATE = 96, 40, 344  # tiny-llama's MLP width; 40 does not divide 2 x 96


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.widest_rows = 0  # most token rows of any [b, s, INTERMEDIATE] activation an op created

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[-1] == INTERMEDIATE:
                self.widest_rows = max(self.widest_rows, t.numel() // INTERMEDIATE)
        return out


def _run(chunk: int, ckpt: bool):
    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    if chunk:
        assert len(apply_mlp_chunking(find_units(model, (LlamaDecoderLayer,), None), chunk_tokens=chunk)) == 4
    if ckpt:
        apply_activation_checkpointing(model, (LlamaDecoderLayer,))
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(2, -1)
    with _Shapes() as seen:
        loss = token_loss_sum(model, ids, ids, pos)
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], seen.widest_rows


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_chunked_mlp_matches_whole_and_never_holds_the_whole_intermediate(ckpt):
    loss, grads, rows = _run(0, ckpt)
    loss_c, grads_c, rows_c = _run(CHUNK, ckpt)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert rows == 2 * SEQ  # the whole path creates b·s x i tensors
    assert rows_c <= 2 * (CHUNK // 2), rows_c  # chunks of 20 positions x 2 rows


def test_chunks_backward_writes_the_input_gradient_once():
    """What the backward of a chunked forward writes grows with the tokens, not with chunks x tokens: a chunk cut out
    by slicing had its backward write a zero-filled gradient of the whole input (64 chunks: 69 MB against 1.6 MB
    unchunked); split's backward concatenates the chunks' gradients once (2.6 MB)."""
    from shardtune.model.tiled_mlp import chunked_forward

    def written(chunk_tokens: int) -> int:
        x = torch.randn(1, 1024, 128, requires_grad=True)
        out = chunked_forward(lambda t: t * 2, x, chunk_tokens=chunk_tokens)
        with BytesCreated() as seen:
            out.backward(torch.ones_like(out))
        return seen.bytes

    whole, chunked = written(1024), written(16)
    assert chunked < 2 * whole, (whole, chunked)
