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
from shardtune.model.tiled_mlp import apply_mlp_chunking, apply_sequence_chunking
from tests.unit.bytes_written import BytesCreated

SEQ, CHUNK, INTERMEDIATE = 96, 40, 344
LONG = 512  # tokens per row where one unit's backward, not the loss, sets an offloaded step's peak  # tiny-llama's MLP width; 40 does not divide 2 x 96


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
    by slicing had its backward write a zero-filled gradient of the whole input (64 chunks: 69 MB); split's backward
    concatenates the chunks' gradients once (1.6 MB against 1.0 MB unchunked, views not counted)."""
    from shardtune.model.tiled_mlp import chunked_forward

    def written(chunk_tokens: int) -> int:
        x = torch.randn(1, 1024, 128, requires_grad=True)
        out = chunked_forward(lambda t: t * 2, x, chunk_tokens=chunk_tokens)
        with BytesCreated() as seen:
            out.backward(torch.ones_like(out))
        return seen.bytes

    whole, chunked = written(1024), written(16)
    assert chunked < 2 * whole, (whole, chunked)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_moe_blocks_chunk_exactly_with_several_rows(name):
    """Mixture-of-experts blocks over 2 rows in chunks that cut rows (40 of 2 x 96 tokens): each chunk is a contiguous
    run of tokens (a sparse block views its input as (tokens, h); a chunk of the sequence across rows is not a view
    of that shape), gpt-oss's MLP returns its router scores too, and the routers' balance loss sees each router's
    chunks joined in token order: loss, balance loss and every gradient as unchunked (fp32, 1e-5)."""
    from shardtune.model.router_loss import RouterBalance

    def run(chunk: int):
        eager = {"attn_implementation": "eager"} if name == "tiny-gpt-oss" else {}
        model = build_model(ModelConfig(config=f"configs/models/{name}.json", **eager), seed=0)
        cls = type(model.model.layers[0])
        if chunk:
            changed = apply_sequence_chunking(find_units(model, (cls,), None), chunk_tokens=chunk)
            assert len(changed["fused"]) == len(model.model.layers)  # their post-attention norm feeds only the MLP
        apply_activation_checkpointing(model, (cls,))
        balance = RouterBalance(model)
        ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
        balance.start()
        loss = token_loss_sum(model, ids, ids, torch.arange(SEQ).expand(2, -1))
        aux = balance.loss(2, 2 * SEQ)
        (loss + aux).backward()
        return loss.detach(), aux.detach(), [p.grad for p in model.parameters()]

    whole, chunked = run(0), run(CHUNK)
    torch.testing.assert_close(chunked[:2], whole[:2], rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_post_attention_norm_runs_inside_the_mlp_chunks():
    """Llama's post-attention norm runs inside each MLP chunk (its own forward is the identity): a checkpointed
    step's peak is one [b, s, h] tensor (the norm's whole output, which the MLP's chunks saved) lower than with the
    norm chunked on its own, with the same loss. Gemma's post-attention norm is on the attention's output: not
    fused there."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer

    from shardtune.engine.offload_activations import ActivationOffloader
    from shardtune.memory import CpuMemoryTracker
    from shardtune.model.tiled_mlp import _block_norm_feeds_only_mlp, apply_norm_chunking

    assert _block_norm_feeds_only_mlp(LlamaDecoderLayer) and not _block_norm_feeds_only_mlp(Gemma2DecoderLayer)

    def peak(fused: bool):
        model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
        units = find_units(model, (LlamaDecoderLayer,), None)
        if fused:
            apply_sequence_chunking(units, chunk_tokens=CHUNK)
            x = torch.ones(1, 2, 128)
            assert units[0].post_attention_layernorm(x) is x
        else:  # the MLP and both norms chunked each on its own
            apply_mlp_chunking(units, chunk_tokens=CHUNK)
            apply_norm_chunking(units, chunk_tokens=CHUNK)
        # unit inputs offloaded: the peak is then one unit's backward, not the checkpointed inputs of all
        apply_activation_checkpointing(model, (LlamaDecoderLayer,), offloader=ActivationOffloader(torch.device("cpu")))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ids = torch.randint(3, 128, (2, LONG), generator=torch.Generator().manual_seed(3))
        tracker = CpuMemoryTracker().start()
        base = tracker.live_bytes()
        try:
            loss = token_loss_sum(model, ids, ids, torch.arange(LONG).expand(2, -1), chunk_tokens=CHUNK)
            loss.backward()
        finally:
            tracker.stop()
        return tracker.peak_bytes() - base, loss.detach()

    (fused, loss), (separate, ref) = peak(True), peak(False)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert separate - fused >= 2 * LONG * 128 * 4 * 3 // 4, (separate, fused)  # less one chunk's norm temporaries
