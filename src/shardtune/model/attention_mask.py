"""Masks for the per-document attention (model/attention.py): none in training, transformers' own for generation.

transformers prepares a mask (masking_utils) for every attention implementation registered with its
AttentionMaskInterface, and in training (position ids, no padding mask, no cache) it first looks for packed sequences
with a `.all()` on the device position ids: a host sync in every forward. An implementation with no mask function
is given no mask at all (transformers' path for attention that needs none): the training forward reads nothing, and
the documents come as host integers (`doc_lengths`). Generation needs a padding mask, which transformers then
drops: a KV cache's steps are masked from their position ids instead (`cached_attention`), and our own decoding
runs on transformers' SDPA for its duration (`generation_attention`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

NAME = "shardtune_sdpa"  # the per-document attention's name (model/attention.py registers it)
GENERATION = "sdpa"  # transformers' SDPA: its mask code handles padding, caches and sliding windows


@contextmanager
def generation_attention(model: Any) -> Iterator[None]:
    """`model` (a PreTrainedModel) on transformers' SDPA while the block runs, when it trains on the per-document
    attention; the same weights and math, masks built by transformers."""
    name = model.config._attn_implementation
    if name != NAME:
        yield
        return
    model.set_attn_implementation(GENERATION)
    try:
        yield
    finally:
        model.set_attn_implementation(name)


def cached_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
    """transformers' SDPA call for queries that are the last q of k cached positions ([b, s, heads, d] out). With
    no mask given, query i (absolute index a = k - q + i, position p) sees keys a - p .. a: its own sequence, as
    transformers' generate numbers positions (from 0 after a row's left padding), with no read of the device."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None:
        b, q, k = query.shape[0], query.shape[2], key.shape[2]
        absolute = torch.arange(k - q, k, device=query.device)[:, None]  # [q, 1]
        keys = torch.arange(k, device=query.device)[None, :]  # [1, k]
        position_ids = kwargs.get("position_ids")
        first = (torch.zeros_like(absolute) if position_ids is None
                 else absolute - position_ids.expand(b, -1)[:, :, None])  # [q, 1] or [b, q, 1]
        attention_mask = ((keys <= absolute) & (keys >= first)).expand(b, q, k)[:, None]
        # transformers passes the layer's window (Mistral keeps it on the config only, not on the module)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None:
            attention_mask = attention_mask & (keys > absolute - window)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
