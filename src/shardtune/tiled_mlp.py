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
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MLP_CHILD = "mlp"


def chunked_forward(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                    chunk_tokens: int) -> torch.Tensor:
    """forward(x) over [b, s, h] `x` in chunks of the sequence holding at most `chunk_tokens` tokens each."""
    b, s = x.shape[0], x.shape[1]
    step = max(1, chunk_tokens // max(1, b))
    if step >= s:
        return forward(x)
    if not torch.is_grad_enabled():
        return torch.cat([forward(x[:, a:a + step]) for a in range(0, s, step)], dim=1)
    return torch.cat([checkpoint(forward, x[:, a:a + step], use_reentrant=False) for a in range(0, s, step)], dim=1)


def apply_mlp_chunking(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """Chunk the MLP of each unit (its `mlp` child) over the sequence; returns the MLP modules changed."""
    assert chunk_tokens > 0
    changed = []
    for unit in units:
        mlp = getattr(unit, MLP_CHILD, None)
        if isinstance(mlp, nn.Module):
            mlp.forward = functools.partial(chunked_forward, mlp.forward, chunk_tokens=chunk_tokens)
            changed.append(mlp)
    return changed
