"""The GPU branch of model/attention.py: packed rows in one varlen call (`torch.nn.attention.varlen.varlen_attn`).

Varlen is flash-only, with no CPU kernel: here the branch runs on the CPU against `_reference_varlen`, the kernel's
contract written out with explicit masks (documents cut at `cu_seq`, query i sees keys i-left .. i, grouped heads
shared), and must give what the per-document path gives: layout, offsets across rows, the window's bounds, grouped
heads and scale. On a lent GPU the last test checks the real kernel against the per-document path.
"""
from __future__ import annotations

import pytest
import torch

from shardtune import accelerator
from shardtune.model import attention, context_parallel

ROWS = ((5, 11, 3, 13), (32,), (1, 30, 1))  # three packed rows of 32 tokens


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """Sequence n: queries cu_q[n]:cu_q[n+1] (maybe none) over keys cu_k[n]:cu_k[n+1]. With fewer queries than keys
    the causal diagonal sits at the bottom right (flash's rule: query i of Lq sees keys up to i + Lk - Lq)."""
    assert q.shape[0] == int(cu_q[-1]) and k.shape[0] == int(cu_k[-1])
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    left, right = window_size
    assert right == 0, "causal only"
    rep = q.shape[1] // k.shape[1]
    assert enable_gqa == (rep > 1)
    out = torch.empty_like(q)
    for a, z, ka, kz in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True):
        if z == a:
            continue
        i = torch.arange(z - a)[:, None] + (kz - ka) - (z - a)
        j = torch.arange(kz - ka)[None, :]
        seen = (j <= i) & ((j >= i - left) if left >= 0 else True)
        kk, vv = (t[ka:kz].repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
        scores = q[a:z].transpose(0, 1) @ kk.transpose(1, 2) * (scale or q.shape[-1] ** -0.5)
        out[a:z] = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out


def _qkv(heads: int, kv_heads: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    b, s, d = len(ROWS), sum(ROWS[0]), 16
    # As the model makes them: [b, s, heads, d] projections, transposed to [b, heads, s, d]
    return [torch.randn(b, s, n, d, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
            for n in (heads, kv_heads, kv_heads)]


def _attend(qkv, window, *, varlen: bool, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(attention, "_varlen_runs", lambda query, dropout: varlen)
    out, _ = attention.document_attention(None, *qkv, None, scaling=0.3, doc_lengths=ROWS, sliding_window=window)
    grads = torch.autograd.grad(out.float().square().sum(), qkv)
    return out, grads


@pytest.mark.parametrize("window", [None, 4, 12], ids=["causal", "window-4", "window-12"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_branch_equals_per_document_calls(monkeypatch, window, kv_heads):
    """Output and q/k/v gradients of the one varlen call equal the per-document SDPA calls' (fp32, 1e-5)."""
    monkeypatch.setattr(attention, "varlen_attn", _reference_varlen)
    qkv = _qkv(4, kv_heads)
    want, want_grads = _attend(qkv, window, varlen=False, monkeypatch=monkeypatch)
    got, got_grads = _attend(qkv, window, varlen=True, monkeypatch=monkeypatch)
    assert got.shape == want.shape == (len(ROWS), sum(ROWS[0]), 4, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _context_parallel_attend(qkv, world: int):
    """Each of `world` ranks' queries and keys of every row (model/context_parallel.py), in one process: a rank's
    gather hands back the whole keys and values. Returns the ranks' outputs side by side and the q/k/v gradients."""
    q, k, v = qkv
    s = q.shape[2] // world
    outs = []
    try:
        for r in range(world):
            k_r, v_r = k[:, :, r * s:(r + 1) * s], v[:, :, r * s:(r + 1) * s]
            context_parallel._GROUP[:] = [context_parallel._Group(r, world, lambda t, k_r=k_r: k if t is k_r else v)]
            context_parallel.set_rows(r * s, (r + 1) * s, ROWS)
            out, _ = attention.document_attention(None, q[:, :, r * s:(r + 1) * s], k_r, v_r, None, scaling=0.3,
                                                  doc_lengths=ROWS)
            outs.append(out)
    finally:
        context_parallel.disable()
    out = torch.cat(outs, dim=1)
    return out, torch.autograd.grad(out.float().square().sum(), qkv)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "per-piece"])
def test_context_parallel_varlen_equals_per_document_calls(monkeypatch, world, varlen):
    """Issue 58 defect 5: context parallelism takes the varlen call where packed rows do (one per layer, not one SDPA
    call per document piece): each document is one sequence of its queries on the rank (none for a document that
    ended before them) over its keys so far. Output and gradients equal the whole rows' per-document calls (fp32,
    1e-5); the per-piece path (CPU, fp32) too. At 2 ranks rank 1 starts after two whole documents of row 0."""
    monkeypatch.setattr(attention, "varlen_attn", _reference_varlen)
    qkv = _qkv(4, 2)
    want, want_grads = _attend(qkv, None, varlen=False, monkeypatch=monkeypatch)
    calls = []
    monkeypatch.setattr(attention, "varlen_attn", lambda *a, **kw: calls.append(1) or _reference_varlen(*a, **kw))
    monkeypatch.setattr(attention, "_varlen_runs", lambda query, dropout: varlen)
    got, got_grads = _context_parallel_attend(qkv, world)
    assert len(calls) == (world if varlen else 0)  # one per rank
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_varlen_offsets_cached_per_batch(monkeypatch):
    """Every layer (and its recompute, and backward) of one batch reuses one device copy of the offsets."""
    seen = []
    monkeypatch.setattr(attention, "varlen_attn", lambda q, k, v, cu, *a, **kw: seen.append(cu) or q.clone())
    monkeypatch.setattr(attention, "_varlen_runs", lambda query, dropout: True)
    attention._cu_seqlens.cache_clear()
    qkv = _qkv(4, 4)
    for _ in range(3):
        attention.document_attention(None, *qkv, None, doc_lengths=ROWS)
    assert seen[0] is seen[1] is seen[2]
    assert seen[0].dtype == torch.int32
    assert seen[0].tolist() == [0, 5, 16, 19, 32, 64, 65, 95, 96]


def test_varlen_runs_where_flash_does():
    """The simulated GPU (meta) and CUDA take varlen for bf16/fp16 without dropout; the CPU, fp32 and dropout keep
    the per-document calls."""
    meta = torch.empty(1, 2, 8, 64, device=accelerator.SIMULATED, dtype=torch.bfloat16)
    assert attention._varlen_runs(meta, 0.0)
    assert not attention._varlen_runs(meta, 0.1)
    assert not attention._varlen_runs(meta.float(), 0.0)
    assert not attention._varlen_runs(torch.empty(1, 2, 8, 64, dtype=torch.bfloat16), 0.0)
    assert not attention._varlen_runs(torch.empty(1, 2, 8, 320, device=accelerator.SIMULATED,
                                                  dtype=torch.bfloat16), 0.0)


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
@pytest.mark.parametrize("window", [None, 12])
def test_varlen_kernel_matches_per_document_sdpa_on_gpu(window):
    """CUDA: the real flash varlen kernel against per-document SDPA calls, bf16 (both flash: same to bf16 rounding)."""
    qkv = _qkv(4, 2, torch.bfloat16, "cuda")
    assert attention._varlen_runs(qkv[0], 0.0)
    got, got_grads = _attend(qkv, window, varlen=True)
    with pytest.MonkeyPatch.context() as mp:
        want, want_grads = _attend(qkv, window, varlen=False, monkeypatch=mp)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
def test_context_parallel_varlen_kernel_on_gpu():
    """CUDA: the real kernel's bottom-right diagonal and its sequences without queries, against the per-piece calls
    of context parallelism (bf16, both flash: same to bf16 rounding)."""
    qkv = _qkv(4, 2, torch.bfloat16, "cuda")
    assert attention._varlen_runs(qkv[0], 0.0)
    got, got_grads = _context_parallel_attend(qkv, 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_varlen_runs", lambda query, dropout: False)
        want, want_grads = _context_parallel_attend(qkv, 2)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
