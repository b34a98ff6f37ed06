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

Where the block's post-attention norm feeds only its MLP (`norm_feeds_only_mlp`: Llama, Mistral, Qwen2/3, Qwen3-MoE,
Mixtral, gpt-oss; not Gemma, whose post-attention norm is on the attention's output), the norm runs inside each MLP
chunk (the norm's own forward becomes the identity): the chunks save views of the residual after attention, which
is alive anyway, and the norm's output, the MLP's input (b·s·h), never exists whole. A unit's backward holds one
b·s·h tensor less: 1 GiB at 128k tokens on an 8B model in bf16.

Chunks are cut over the batch's tokens taken as one sequence ([b, s, h] viewed as [1, b·s, h]): each chunk is then
contiguous, which a mixture-of-experts block needs (it views its input as (tokens, h)), and its tokens are in the
order of that view, so a router's per-chunk outputs concatenate into the whole block's.
"""
from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Set on each unit apply_sequence_chunking changes: its chunks are checkpointed on their own, which the unit's
# checkpoint must not replay whole (engine/checkpointing.py replayable)
SEQUENCE_CHUNKED = "_shardtune_sequence_chunked"
MLP_CHILD = "mlp"
NORM_CHILDREN = ("input_layernorm", "post_attention_layernorm")  # HF decoder blocks' two RMSNorms
MLP_NORM = NORM_CHILDREN[1]
# In the block's forward, the post-attention norm's output goes straight into the MLP and is overwritten by the
# MLP's output (gpt-oss's MLP also returns its router scores): nothing else reads it.
_NORM_THEN_MLP = re.compile(rf"hidden_states = self\.{MLP_NORM}\(hidden_states\)\s*\n"
                            rf"\s*hidden_states(, _)? = self\.{MLP_CHILD}\(hidden_states\)")


def chunked_forward(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                    chunk_tokens: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """forward(x) over [b, s, h] `x` in chunks of at most `chunk_tokens` of its b·s tokens. forward may return a
    tuple (gpt-oss's MLP: its output and the router scores, (tokens, experts)): each part is concatenated."""
    b, s = x.shape[0], x.shape[1]
    if b * s <= chunk_tokens:
        return forward(x)
    flat = x.reshape(1, b * s, *x.shape[2:])
    # split, not flat[:, a:a + step]: split's backward concatenates the chunks' gradients once, where each slice's
    # backward would write a zero-filled gradient of the whole x (s / step times the bytes of x per MLP or norm).
    chunks = flat.split(chunk_tokens, dim=1)
    if torch.is_grad_enabled():
        outs = [checkpoint(forward, c, use_reentrant=False) for c in chunks]
    else:
        outs = [forward(c) for c in chunks]
    if isinstance(outs[0], tuple):
        return tuple(_join(list(part), b, s) for part in zip(*outs, strict=True))
    return _join(outs, b, s)


def _join(parts: list[torch.Tensor], b: int, s: int) -> torch.Tensor:
    """Chunks' outputs -> the whole: [1, n, ...] pieces back to [b, s, ...]; (n, ...) pieces (per token) stacked."""
    if parts[0].dim() >= 3:
        out = torch.cat(parts, dim=1)
        return out.view(b, s, *out.shape[2:])
    return torch.cat(parts, dim=0)


@functools.cache
def _block_norm_feeds_only_mlp(block_class: type) -> bool:
    declared = getattr(block_class, "NORM_FEEDS_ONLY_MLP", None)  # plan/skeleton.py's stand-ins have no forward
    if declared is not None:
        return declared
    try:
        return bool(_NORM_THEN_MLP.search(inspect.getsource(block_class.forward)))
    except (OSError, TypeError):  # no source to read: keep the norm as its own chunked module
        return False


def norm_feeds_only_mlp(unit: nn.Module) -> bool:
    """Whether `unit`'s post-attention norm can run inside its MLP's chunks (the module docstring)."""
    return (isinstance(getattr(unit, MLP_NORM, None), nn.Module) and isinstance(getattr(unit, MLP_CHILD, None), nn.Module)
            and _block_norm_feeds_only_mlp(type(unit)))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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


def _norm_then(norm: Callable[[torch.Tensor], torch.Tensor],
               mlp: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: mlp(norm(x))


def apply_fused_norm_mlp_chunking(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """For each unit where `norm_feeds_only_mlp`: the post-attention norm inside each MLP chunk, its own forward the
    identity. Returns the MLP modules changed (each unit's norm is changed with it)."""
    changed = []
    for unit in units:
        if norm_feeds_only_mlp(unit):
            norm, mlp = getattr(unit, MLP_NORM), getattr(unit, MLP_CHILD)
            mlp.forward = functools.partial(chunked_forward, _norm_then(norm.forward, mlp.forward),
                                            chunk_tokens=chunk_tokens)
            norm.forward = _identity
            changed.append(mlp)
    return changed


def apply_mlp_chunking(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """Chunk the MLP of each unit (its `mlp` child) over the sequence; returns the MLP modules changed."""
    return _chunk_children(units, (MLP_CHILD,), chunk_tokens)


def apply_norm_chunking(units: list[nn.Module], *, chunk_tokens: int,
                        names: tuple[str, ...] = NORM_CHILDREN) -> list[nn.Module]:
    """Chunk each unit's RMSNorms (`names`) over the sequence; returns the norm modules changed."""
    return _chunk_children(units, names, chunk_tokens)


def apply_sequence_chunking(units: list[nn.Module], *, chunk_tokens: int) -> dict[str, list[nn.Module]]:
    """engine.mlp_chunk_tokens: each unit's MLP, RMSNorms and LoRA adapter branches (model/chunked_lora.py) over chunks of
    the sequence: what a unit keeps, or makes in fp32, of the whole sequence's width is then only in the compute
    dtype (its input, the residual, the attention's tensors and the attention's input). Returns the modules
    changed: "mlp" (with its norm where fused), "fused" (those MLPs), "norms" (the norms chunked on their own)."""
    from shardtune.model.chunked_lora import apply_chunked_lora

    for u in units:
        u.__dict__[SEQUENCE_CHUNKED] = True
    rest = [u for u in units if not norm_feeds_only_mlp(u)]  # before fusing: it reads the children's modules
    fused = apply_fused_norm_mlp_chunking(units, chunk_tokens=chunk_tokens)
    return {"mlp": fused + apply_mlp_chunking(rest, chunk_tokens=chunk_tokens), "fused": fused,
            "norms": (apply_norm_chunking(units, chunk_tokens=chunk_tokens, names=NORM_CHILDREN[:1])
                      + apply_norm_chunking(rest, chunk_tokens=chunk_tokens, names=NORM_CHILDREN[1:])),
            "adapters": apply_chunked_lora(units, chunk_tokens=chunk_tokens)}
