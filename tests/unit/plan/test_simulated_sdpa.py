"""plan --simulate's SDPA takes the kernel CUDA dispatches to (plan/simulate.py `_cuda_sdpa`): with the packing mask,
the memory-efficient kernel keeps a bias of the mask's shape in the query's dtype for backward, per layer, which
the plan counts (estimate.py `activation_bytes_per_layer`); without a mask, flash keeps none."""
from __future__ import annotations

import torch

from shardtune.plan.simulate import _cuda_sdpa


def _saved(attn_mask: torch.Tensor | None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    q, k, v = (torch.empty(2, 4, 64, 16, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _cuda_sdpa(q, k, v, attn_mask=attn_mask)
    return saved


def test_packing_mask_is_a_saved_bias_per_call() -> None:
    mask = torch.empty(2, 1, 64, 64, dtype=torch.bool, device="meta")
    assert ((2, 1, 64, 64), torch.bfloat16) in _saved(mask)
    assert not [s for s in _saved(None) if s[0][-2:] == (64, 64)]  # flash: no s x s tensor kept
