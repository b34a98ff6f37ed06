"""Gradient clipping pieces both backends share: a squared norm where the collectives run, and the scaling of
gradients that may live on the host (cpu_offload) while the norm lives on the device."""
from __future__ import annotations

import torch

from shardtune import accelerator


def sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of `grads` (fp32 scalar on `device`, where the collectives run). The norms of all the tensors
    on one device in one multi-tensor call (a few kernels on a GPU, not one per tensor: 448 LoRA adapters at 8B);
    each is the one `torch.linalg.vector_norm` gives."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    sums = []
    for dev in dict.fromkeys(g.device for g in grads):  # offload: host shards' gradients beside device ones
        norms = torch._foreach_norm([g for g in grads if g.device == dev], 2, dtype=torch.float32)
        sums.append(torch.stack(norms).square().sum().to(device))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def scale_grads_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Clip in place to `max_norm` given the global norm `total` (torch's clip_grads_with_norm_ formula). Host
    gradients take a host copy of the coefficient: one blocking read on an accelerator."""
    if max_norm <= 0 or not grads:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dev in {g.device for g in grads}:
        scale = coef.to(dev) if dev == coef.device or coef.device.type == "cpu" else accelerator.to_host(coef)
        torch._foreach_mul_([g for g in grads if g.device == dev], scale)
