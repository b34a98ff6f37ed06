"""`engine.mlp_chunk_tokens`: each decoder block's MLP runs over chunks of the sequence, so its intermediate
(gate, up, act(gate)·up: 3-4 tensors of b·s·i, 3.5x the hidden size on Llama) never exists for the whole sequence.

Each chunk is a non-reentrant checkpoint of the MLP's own forward: in forward a chunk's intermediates are freed as
soon as its output is written; in backward each chunk is recomputed and differentiated alone, so at most one
chunk's intermediates (and their gradients) are alive. The chunks' outputs are concatenated (b·s·h, the size of the
MLP's output anyway). Parameter gradients flow through the ordinary graph (summed over chunks by autograd before
any hook of either engine sees them). Nested inside activation checkpointing the recompute of a unit re-runs the
chunked forward, so the MLP is computed three times per step instead of two (+~1/3 of the MLP's FLOPs, ~+20 % of
a step); the saving is (1 - C/(b·s)) of the MLP's working set in the recompute and in backward.
Which module is the MLP is data: the decoder block's child named `mlp` (HF Llama, Mistral, Qwen2/3, Gemma).

The block's two RMSNorms run the same way (`apply_norm_chunking`): HF's norm saves its fp32 upcast of the input
(b·s·h·4 B each, 2 GiB per norm at 128k tokens on an 8B model); chunked and checkpointed, each saves only a view of
its own input (the unit input, and the residual after attention: b·s·h in the compute dtype), and its fp32 copy
exists one chunk at a time, in forward and again in backward. A norm is per token (its sum runs over the hidden
size), so each chunk's output is the whole norm's; the weight gradient is a sum over chunks.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MLP_CHILD = "mlp"
NORM_CHILDREN = ("input_layernorm", "post_attention_layernorm")  # HF decoder blocks' two RMSNorms


def chunked_forward(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                    chunk_tokens: int) -> torch.Tensor:
    """forward(x) over [b, s, h] `x` in chunks of the sequence holding at most `chunk_tokens` tokens each."""
    b, s = x.shape[0], x.shape[1]
    step = max(1, chunk_tokens // max(1, b))
    if step >= s:
        return forward(x)
    # split, not x[:, a:a + step]: split's backward concatenates the chunks' gradients once, where each slice's
    # backward would write a zero-filled gradient of the whole x (s / step times the bytes of x per MLP or norm).
    if not torch.is_grad_enabled():
        return torch.cat([forward(c) for c in x.split(step, dim=1)], dim=1)
    return torch.cat([checkpoint(forward, c, use_reentrant=False) for c in x.split(step, dim=1)], dim=1)


def _chunk_children(units: list[nn.Module], names: tuple[str, ...], chunk_tokens: int) -> list[nn.Module]:
    assert chunk_tokens > 0
    changed = []
    for unit in units:
        for name in names:
            child = getattr(unit, name, None)
            if isinstance(child, nn.Module):
                child.forward = functools.partial(chunked_forward, child.forward, chunk_tokens=chunk_tokens)
                changed.append(child)
    return changed


def apply_mlp_chunking(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """Chunk the MLP of each unit (its `mlp` child) over the sequence; returns the MLP modules changed."""
    return _chunk_children(units, (MLP_CHILD,), chunk_tokens)


def apply_norm_chunking(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """Chunk each unit's RMSNorms (NORM_CHILDREN) over the sequence; returns the norm modules changed."""
    return _chunk_children(units, NORM_CHILDREN, chunk_tokens)


def apply_sequence_chunking(units: list[nn.Module], *, chunk_tokens: int) -> dict[str, list[nn.Module]]:
    """engine.mlp_chunk_tokens: each unit's MLP, RMSNorms and LoRA adapter branches (model/chunked_lora.py) over chunks of
    the sequence: what a unit keeps, or makes in fp32, of the whole sequence's width is then only in the compute
    dtype (its input, the residual, the attention's tensors and the norms' outputs). Returns the modules changed."""
    from shardtune.model.chunked_lora import apply_chunked_lora

    return {"mlp": apply_mlp_chunking(units, chunk_tokens=chunk_tokens),
            "norms": apply_norm_chunking(units, chunk_tokens=chunk_tokens),
            "adapters": apply_chunked_lora(units, chunk_tokens=chunk_tokens)}
