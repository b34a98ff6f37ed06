"""torch's fused RMSNorm on the simulated GPU, as CUDA runs it: `F.rms_norm` one `aten::_fused_rms_norm` kernel
forward and one `_fused_rms_norm_backward` backward (model/rms_norm.py routes the decoder's norms through it).

`aten::rms_norm`'s C++ composite calls `_fused_rms_norm` on every device (bar channels-last, complex and a weight
of another dtype, where it decomposes itself); the device decides in `_fused_rms_norm`'s dispatch. CUDA has a
kernel; a CPU build has none but the op's CompositeImplicitAutograd decomposition (pow, mean, add, rsqrt, mul, ...),
which meta tensors take too: the launch counter counted ~6 forward and ~12 backward kernels where CUDA runs two.
So a Meta kernel for `_fused_rms_norm` (installed with the simulated GPU, never on a real run), sizing its outputs
as CUDA's does: the output like the input, contiguous; rstd in the accumulation dtype, the outer dims with a 1 per
normalised dim. With a Meta kernel the op's AutogradMeta entry becomes torch's generated autograd, as AutogradCUDA's
is (FusedRmsNormBackward0, saving input and rstd), whose backward calls `_fused_rms_norm_backward` (torch's own meta
kernel sizes that one). The CPU keeps the decomposition: its numerics are untouched.
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


def install(libs: list[Any]) -> None:
    """Register the kernel (appending its library to `libs`, which keeps it alive); nothing if this torch has no
    fused op, or already has a Meta kernel for it."""
    if not hasattr(torch.ops.aten, "_fused_rms_norm") or \
            torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "Meta"):
        return
    lib = torch.library.Library("aten", "IMPL")
    # torch.library refuses a Meta kernel beside a CompositeImplicitAutograd one (it prefers decompositions for
    # tracing); the decomposition is what the simulated GPU must not run, so register through the C++ library.
    lib.m.impl("_fused_rms_norm", "Meta", _fused_rms_norm_meta, False)
    libs.append(lib)
