"""torch's fused RMSNorm on the simulated GPU, as CUDA runs it: `F.rms_norm` one `aten::_fused_rms_norm` kernel
forward and one `_fused_rms_norm_backward` backward (model/rms_norm.py routes the decoder's norms through it).

A CPU build has no kernel for `_fused_rms_norm` but its CompositeImplicitAutograd decomposition (pow, mean, add,
rsqrt, mul, ...), and `aten::rms_norm`'s C++ composite takes the fused op only on CUDA-class devices, by device
type: on meta it decomposes, and the launch counter would count ~6 forward and ~12 backward kernels where CUDA runs
two. So, on the meta device only (installed with the simulated GPU, never on a real run):
  - a Meta kernel for `_fused_rms_norm` sizing its outputs as CUDA's does (the output like the input, contiguous;
    rstd in the accumulation dtype, the outer dims with a 1 per normalised dim). With a Meta kernel its
    AutogradMeta entry becomes torch's generated autograd (FusedRmsNormBackward0, saving input and rstd), whose
    backward calls `_fused_rms_norm_backward` (torch's own meta kernel sizes that one);
  - `rms_norm` at AutogradMeta calling the fused op, the branch CUDA's composite takes.
"""
from __future__ import annotations

from typing import Any

import torch

_OP = "aten::_fused_rms_norm"


def _fused_rms_norm_meta(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                         eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    axis = input.dim() - len(normalized_shape)
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32  # CUDA's accumulate type of a float
    out = torch.empty_like(input, memory_format=torch.contiguous_format)
    rstd = input.new_empty((*input.shape[:axis], *([1] * len(normalized_shape))), dtype=acc)
    return out, rstd


def _rms_norm_fused(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                    eps: float | None = None) -> torch.Tensor:
    return torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)[0]


def install(libs: list[Any]) -> None:
    """Register both kernels (appending their library to `libs`, which keeps them alive); nothing if this torch has
    no fused op, or already has a Meta kernel for it."""
    if not hasattr(torch.ops.aten, "_fused_rms_norm") or \
            torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "Meta"):
        return
    lib = torch.library.Library("aten", "IMPL")
    # torch.library refuses a Meta kernel beside a CompositeImplicitAutograd one (it prefers decompositions for
    # tracing); the decomposition is what the simulated GPU must not run, so register through the C++ library.
    lib.m.impl("_fused_rms_norm", "Meta", _fused_rms_norm_meta, False)
    lib.impl("rms_norm", _rms_norm_fused, "AutogradMeta")
    libs.append(lib)
