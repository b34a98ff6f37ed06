"""plan --simulate's stand-in for CUDA's SDPA (plan/simulate.py `_cuda_sdpa`): without a mask it is the flash
kernel, which reads grouped k/v heads as they are. What backward keeps must be the caller's k and v, not copies
repeated to every query head (a copy per layer the GPU never makes)."""
from __future__ import annotations

import torch

from shardtune.plan.simulate import _cuda_sdpa


def test_flash_keeps_grouped_keys_and_values_unrepeated():
    q = torch.empty(2, 8, 16, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 2, 16, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(2, 2, 16, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = _cuda_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape
    saved = out.grad_fn
    assert saved._saved_key.shape == k.shape and saved._saved_value.shape == v.shape
    out.sum().backward()
    assert k.grad.shape == k.shape and q.grad.shape == q.shape
