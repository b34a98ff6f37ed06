"""Attention over packed rows with no s x s tensor: one causal SDPA call per document.

transformers' own `sdpa` path turns packed rows (position ids restarting per document) into a (b,1,s,s) boolean
mask, which SDPA turns into a bias per layer and which rules out its flash kernel: s^2 memory (at 128k tokens,
32 GiB per row in bf16). Here every document of a row is attended to by its own `is_causal` SDPA call, so no mask
is ever built and the fused kernels (flash / memory-efficient on a GPU, flash on the CPU) run.

On a GPU, a packed row goes to varlen attention instead (`torch.nn.attention.varlen.varlen_attn`: flash over
cu_seqlens, one call per layer for every document of the batch, sliding windows included). Measured on an H200
(bench/RESULTS.md, stop 54): with one SDPA call per document, a 1B LoRA step on rows of ~97 short documents was
host-bound at ~2,500 tokens/s, its time in the launch loop. Varlen is flash-only (bf16/fp16, head_dim <= 256, no
dropout) and has no CPU kernel, so the per-document calls stay for the CPU, fp32 and dropout.

Why per-document calls there, and not the alternatives:
  - flex attention with a document block mask: exact and one call, but fast only when compiled (the eager CPU
    fallback materialises the s x s scores); compiling per shape costs minutes on the 2-core test machine.
  - per-document SDPA: exact on every device, no compile, s^2-free. Cost: one kernel launch per document per layer
    (and per recompute); its output is assembled with one copy (b*s*h, the size of the attention output).
A sliding window (Mistral, Qwen2, Gemma: transformers passes the layer's `sliding_window`, W)
lets query i see keys i-W+1 .. i. A document no longer than W is plain causal attention; a longer one runs in blocks
of at most WINDOW_BLOCK queries, each against only the keys its window reaches, under a band bias built once per
call (`_Band`): exact, no s x s tensor, compute (block + W) / W times the band's.
Documents reach the attention as host integers (`doc_lengths`, from the batch's host position ids before the copy
to the device): reading them from the device position ids would be a device-to-host sync in every forward.

No mask function is registered with transformers, so its mask code reads no position ids (model/attention_mask.py). A
left-padded prompt is documents too (transformers' generate numbers the padding apart); a KV cache's steps are
masked from the position ids (attention_mask.cached_attention). Our own decoding runs on transformers' SDPA.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.varlen import varlen_attn

from shardtune import accelerator
from shardtune.data import packing
from shardtune.model import context_parallel
from shardtune.model.attention_mask import (  # NAME: the attn_implementation `sdpa` builds
    NAME,
    cached_attention,
)


def document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                       doc_lengths: packing.DocLengths | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [b, heads, s, d], key/value [b, kv_heads, s, d] -> ([b, s, heads, d], None), as transformers expects."""
    if context_parallel.active():  # this rank's part of each row, over the group's keys and values
        gqa = key.shape[1] != query.shape[1]
        if _varlen_runs(query, dropout):  # every document piece of the batch in one call (no window: refused)
            keys, values = context_parallel.gather(key, value)
            queries, documents = context_parallel.document_lengths()
            return _varlen(query, keys, values, queries, scaling, None, gqa, key_lengths=documents), None
        out = context_parallel.attention(query, key, value, lambda q, k, v: _sdpa(q, k, v, scaling, dropout, gqa))
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None or query.shape[2] != key.shape[2]:  # a 4-D mask of the caller's, or a KV cache
        return cached_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                **kwargs), None
    if isinstance(doc_lengths, torch.Tensor):  # packed rows in a compiled block (engine/compile.py): one custom op
        if dropout:
            raise ValueError("attention dropout in a compiled block over packed rows: its backward recomputes the "
                             "attention; set engine.compile=false or data.packing=false")
        return document_attention_op(query, key, value, doc_lengths, scaling, kwargs.get("sliding_window")), None
    b, _, s, _ = query.shape
    gqa = key.shape[1] != query.shape[1]
    window = kwargs.get("sliding_window")  # None on full-attention layers and models without one
    position_ids = kwargs.get("position_ids")
    if doc_lengths is None and position_ids is not None:
        # A caller that did not pass its documents: read them from the device (a sync per layer on a GPU, counted on
        # the simulated one; the trainer's and eval's batches carry them). The simulated GPU has no values to read:
        # one document per row there.
        ids = accelerator.host_values(position_ids.expand(b, -1))
        doc_lengths = packing.doc_lengths(ids) if ids is not None else None
    if (doc_lengths is None or all(len(row) == 1 for row in doc_lengths)) and (window is None or s <= window):
        return _sdpa(query, key, value, scaling, dropout, gqa).transpose(1, 2).contiguous(), None
    doc_lengths = doc_lengths or ((s,),) * b
    assert len(doc_lengths) == b and all(sum(row) == s for row in doc_lengths), "doc_lengths match the batch"
    if _varlen_runs(query, dropout):
        return _varlen(query, key, value, doc_lengths, scaling, window, gqa), None
    band = _Band(window, query) if window is not None and max(map(max, doc_lengths)) > window else None
    rows = []
    # Documents cut out by split, not by indexing: split's backward assembles each input's gradient in one
    # concatenation, where an index's backward would write a zero-filled gradient of the whole input per document.
    for lengths, *qkv in zip(doc_lengths, *(t.split(1) for t in (query, key, value)), strict=True):
        parts = []
        for n, q, k, v in zip(lengths, *(t.split(lengths, dim=2) for t in qkv), strict=True):
            parts.append(_sdpa(q, k, v, scaling, dropout, gqa) if band is None or n <= window
                         else band.attend(q, k, v, scaling, dropout))
        rows.append(parts)
    # [1, heads, n, d] pieces -> [b, s, heads, d]: each piece transposed, concatenated along the sequence
    out = torch.cat([torch.cat([p.transpose(1, 2) for p in parts], dim=1) for parts in rows], dim=0)
    return out, None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, dropout: float,
          gqa: bool) -> torch.Tensor:
    # Looked up at call time (not bound at import): plan --simulate swaps in the fused kernel's meta twin.
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                          enable_gqa=gqa)


def varlen_applies(*, on_gpu: bool, dtype: torch.dtype, head_dim: int, dropout: float) -> bool:
    """Whether packed rows go to the flash varlen kernel: a GPU (or the simulated one), bf16/fp16, no attention
    dropout, head_dim flash takes. The plan (plan/estimate.py) asks the same question from the recipe."""
    return (on_gpu and dtype in (torch.bfloat16, torch.float16) and dropout == 0.0 and head_dim <= 256
            and head_dim % 8 == 0)


def _varlen_runs(query: torch.Tensor, dropout: float) -> bool:
    return varlen_applies(on_gpu=accelerator.is_accelerator(query.device), dtype=query.dtype,
                          head_dim=query.shape[-1], dropout=dropout)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, doc_lengths: packing.DocLengths,
            scaling: float | None, window: int | None, gqa: bool, *,
            key_lengths: packing.DocLengths | None = None) -> torch.Tensor:
    """Every document of every row in one flash call: the rows laid end to end ([b*s, heads, d]), the documents
    cut by cumulative offsets. Query i sees keys i-W+1 .. i of its document (window_size (W-1, 0)), as `_Band`.
    `key_lengths` (context parallelism): the documents' keys, when a row has more keys than queries; flash then
    aligns each document's queries with its last keys (causal at the bottom right)."""
    b, h, s, d = query.shape
    q = query.transpose(1, 2).reshape(b * s, h, d)
    k, v = (t.transpose(1, 2).reshape(b * t.shape[2], t.shape[1], d) for t in (key, value))
    q_offsets, q_longest = _cu_seqlens(tuple(map(tuple, doc_lengths)), query.device)
    k_offsets, k_longest = (q_offsets, q_longest) if key_lengths is None else \
        _cu_seqlens(tuple(map(tuple, key_lengths)), query.device)
    out = varlen_attn(q, k, v, q_offsets, k_offsets, q_longest, k_longest, scale=scaling, enable_gqa=gqa,
                      window_size=(-1, 0) if window is None else (window - 1, 0))
    return out.view(b, s, h, d)


@functools.lru_cache(maxsize=8)  # a batch's documents, and under context parallelism its keys
def _cu_seqlens(doc_lengths: packing.DocLengths, device: torch.device) -> tuple[torch.Tensor, int]:
    """The documents' start offsets (and the end) as int32 on `device`, and the longest document. Cached: every
    layer, its recompute and its backward ask for the same batch's; the copy is pinned and non-blocking (no sync)."""
    lengths = [n for row in doc_lengths for n in row]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return accelerator.to_device(offsets, device), max(lengths)


WINDOW_BLOCK = 1024  # queries per block of a windowed document: the bias is WINDOW_BLOCK x (WINDOW_BLOCK + W - 1)


class _Band:
    """Sliding-window attention over one long document, by query blocks of B = min(W, WINDOW_BLOCK): block [a, a+B)
    reads keys [a-W+1, a+B), where key j is seen by query i iff i-W < j <= i, that is (in block coordinates
    ii = i-a, jj = j-(a-W+1)) iff ii <= jj <= ii+W-1: the same band for every block, so one additive bias in the
    query's dtype serves every block of every document in the call (a boolean mask would be turned into a new bias
    by each SDPA call, and each kept for backward). The first block starts at key 0: its keys are its own
    queries, causal. Grouped key/value heads are repeated per block: CUDA's memory-efficient kernel, the one that
    takes a bias, reads no grouped heads."""

    def __init__(self, window: int, like: torch.Tensor) -> None:
        self.window, self.block = window, min(window, WINDOW_BLOCK)
        ii = torch.arange(self.block, device=like.device)[:, None]
        jj = torch.arange(self.block + window - 1, device=like.device)[None, :]
        seen = (jj >= ii) & (jj <= ii + window - 1)
        self.bias = torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill_(~seen, float("-inf"))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
               dropout: float) -> torch.Tensor:
        n, w = q.shape[2], self.window
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # The query blocks by split (one gradient concatenation in backward); the key windows overlap, so they are
        # slices, each of whose backward writes a zero-filled gradient of the document's keys and values.
        blocks = q.split(self.block, dim=2)
        parts = [_sdpa(blocks[0], k[:, :, :self.block], v[:, :, :self.block], scaling, dropout, False)]
        for a, qb in zip(range(self.block, n, self.block), blocks[1:], strict=True):
            rows, first = qb.shape[2], max(0, a - w + 1)  # a block before key W-1 starts at key 0
            skip = first - (a - w + 1)  # the band's columns for keys before the document
            parts.append(F.scaled_dot_product_attention(qb, k[:, :, first:a + rows],
                                                        v[:, :, first:a + rows],
                                                        attn_mask=self.bias[:rows, skip:rows + w - 1],
                                                        dropout_p=dropout, scale=scaling))
        return torch.cat(parts, dim=2)


def sliding_window(config: Any) -> int | None:
    """The window transformers gives the attention of some layer: `sliding_window`, unless the config switches it
    off (Qwen2's use_sliding_window) or names every layer full attention (layer_types)."""
    w = getattr(config, "sliding_window", None)
    if not w or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    return None if types is not None and "sliding_attention" not in types else int(w)


def register() -> str:
    """Register the attention with transformers (idempotent); returns the name to build models with. No mask
    function: transformers then prepares no mask (model/attention_mask.py says why)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, document_attention)
    return NAME


def attn_implementation(name: str) -> str:
    """The recipe's `model.attn_implementation` -> what transformers builds: sdpa becomes the per-document path."""
    return register() if name == "sdpa" else name


# -- the compiled form over packed rows: a torch.library custom op (engine/compile.py) ----------------------


def document_attention_op(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                       window: int | None) -> Tensor:
    """`document_attention` over packed rows whose documents come as `lengths` (host int64, (rows,
    seq_len): each row's document lengths, then zeros) -> [b, s, heads, d]."""
    return _document_attention(query, key, value, lengths, scaling, window)


def _eager_attention(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                     window: int | None) -> Tensor:
    docs = tuple(tuple(n for n in row if n) for row in lengths.tolist())  # a host tensor: no device sync
    extra = {} if window is None else {"sliding_window": window}
    return document_attention(None, query, key, value, None, scaling=scaling, doc_lengths=docs, **extra)[0]


@torch.library.custom_op("shardtune::document_attention", mutates_args=())
def _document_attention(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
                        window: int | None) -> Tensor:
    return _eager_attention(query, key, value, lengths, scaling, window).contiguous()


@_document_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
      window: int | None) -> Tensor:
    b, h, s, d = query.shape
    return query.new_empty(b, s, h, d)


@torch.library.custom_op("shardtune::document_attention_backward", mutates_args=())
def _document_attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lengths: Tensor,
                                 scaling: float | None, window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: _eager_attention(q, k, v, lengths, scaling, window), query, key, value)
    return tuple(g.contiguous() for g in vjp(grad.contiguous()))


@_document_attention_backward.register_fake
def _(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scaling: float | None,
      window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.meta = inputs[4:]


def _attention_bwd(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    return (*_document_attention_backward(grad, *ctx.saved_tensors, *ctx.meta), None, None, None)


_document_attention.register_autograd(_attention_bwd, setup_context=_attention_setup)
