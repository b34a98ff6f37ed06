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
from shardtune.model import attention

ROWS = ((5, 11, 3, 13), (32,), (1, 30, 1))  # three packed rows of 32 tokens


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    left, right = window_size
    assert right == 0, "causal only"
    rep = q.shape[1] // k.shape[1]
    assert enable_gqa == (rep > 1)
    out = torch.empty_like(q)
    for a, z in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        i = torch.arange(z - a)[:, None]
        j = torch.arange(z - a)[None, :]
        seen = (j <= i) & ((j >= i - left) if left >= 0 else True)
        kk, vv = (t[a:z].repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
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
