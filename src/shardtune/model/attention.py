"""Attention over packed rows with no s x s tensor: one causal SDPA call per document.

transformers' own `sdpa` path turns packed rows (position ids restarting per document) into a (b,1,s,s) boolean
mask, which SDPA turns into a bias per layer and which rules out its flash kernel: s^2 memory (at 128k tokens,
32 GiB per row in bf16). Here every document of a row is attended to by its own `is_causal` SDPA call, so no mask
is ever built and the fused kernels (flash / memory-efficient on a GPU, flash on the CPU) run.

Why per-document calls, and not the alternatives:
  - varlen attention (`torch.nn.attention.varlen`, transformers' flash_attention_2 packing): one call over
    cu_seqlens, but flash-only, CUDA-only (no CPU kernel in torch 2.13): the CPU tests could not check it.
  - flex attention with a document block mask: exact and one call, but fast only when compiled (the eager CPU
    fallback materialises the s x s scores); compiling per shape costs minutes on the 2-core test machine.
  - per-document SDPA: exact on every device, no compile, s^2-free. Cost: one kernel launch per document per layer
    (and per recompute): a few dozen at long sequences, where each call is large; its output is assembled with one
    copy (b*s*h, the size of the attention output).
Documents reach the attention as host integers (`doc_lengths`, from the batch's host position ids before the copy
to the device): reading them from the device position ids would be a device-to-host sync in every forward.

No mask function is registered with transformers, so its mask code reads no position ids (model/attention_mask.py). A
left-padded prompt is documents too (transformers' generate numbers the padding apart); a KV cache's steps are
masked from the position ids (attention_mask.cached_attention). Our own decoding runs on transformers' SDPA.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardtune.data import packing
from shardtune.model.attention_mask import (  # NAME: the attn_implementation `sdpa` builds
    NAME,
    cached_attention,
)


def document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                       doc_lengths: packing.DocLengths | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [b, heads, s, d], key/value [b, kv_heads, s, d] -> ([b, s, heads, d], None), as transformers expects."""
    if attention_mask is not None or query.shape[2] != key.shape[2]:  # a 4-D mask of the caller's, or a KV cache
        return cached_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                **kwargs), None
    b, _, s, _ = query.shape
    gqa = key.shape[1] != query.shape[1]
    position_ids = kwargs.get("position_ids")
    if doc_lengths is None and position_ids is not None and not position_ids.is_meta:
        # A caller that did not pass its documents: read them from the device (a sync per layer on a GPU; the
        # trainer's and eval's batches carry them). Meta tensors (plan --simulate) have no values: one per row.
        doc_lengths = packing.doc_lengths(position_ids.expand(b, -1).cpu())
    if doc_lengths is None or all(len(row) == 1 for row in doc_lengths):
        return _sdpa(query, key, value, scaling, dropout, gqa).transpose(1, 2).contiguous(), None
    assert len(doc_lengths) == b and all(sum(row) == s for row in doc_lengths), "doc_lengths match the batch"
    rows = []
    for r, lengths in enumerate(doc_lengths):
        parts, start = [], 0
        for n in lengths:
            sl = slice(start, start + n)
            parts.append(_sdpa(query[r:r + 1, :, sl], key[r:r + 1, :, sl], value[r:r + 1, :, sl],
                               scaling, dropout, gqa))
            start += n
        rows.append(parts)
    # [1, heads, n, d] pieces -> [b, s, heads, d]: each piece transposed, concatenated along the sequence
    out = torch.cat([torch.cat([p.transpose(1, 2) for p in parts], dim=1) for parts in rows], dim=0)
    return out, None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, dropout: float,
          gqa: bool) -> torch.Tensor:
    # Looked up at call time (not bound at import): plan --simulate swaps in the fused kernel's meta twin.
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                          enable_gqa=gqa)


def register() -> str:
    """Register the attention with transformers (idempotent); returns the name to build models with. No mask
    function: transformers then prepares no mask (model/attention_mask.py says why)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, document_attention)
    return NAME


def attn_implementation(name: str) -> str:
    """The recipe's `model.attn_implementation` -> what transformers builds: sdpa becomes the per-document path."""
    return register() if name == "sdpa" else name
