"""bf16 matrix products on this suite's CPUs as a GPU computes them, at fp32 GEMM speed: inputs widened to fp32
(exact), one fp32 GEMM (fp32 accumulation), the result rounded to bf16 once. Imported by the rank server
(tests/ranks.py), so every forked rank has it; CLI runs keep torch's own kernels.

Why: on a CPU without AVX-512 BF16 (these 2-core AMD machines: AVX2 only), ATen's bf16 GEMM is a scalar fallback,
~10x slower than the fp32 GEMM on the same shapes (a 512x256 by 256x688 product: 29 ms against 2.8 ms widened), and
the suite's bf16 runs spent most of their time there. The arithmetic is the same: ATen's fallback also widens each
product and accumulates in fp32 before rounding once (cuBLAS's bf16 GEMM does too); only the order of the sums may
differ. Registered for the CPU dispatch key below autograd and below any TorchDispatchMode, so what a memory
tracker sees (the op and its bf16 output) is unchanged; the fp32 temporaries live inside the kernel, as ATen's own
workspace would. Other dtypes go to the same ops' `.out` kernels, which are untouched.
"""
from __future__ import annotations

import warnings

import torch

aten = torch.ops.aten
_LIB = torch.library.Library("aten", "IMPL")
_BF16 = torch.bfloat16


def _wide(*tensors: torch.Tensor) -> bool:
    """All bf16: the products to widen (mixed dtypes go to the `.out` kernels, which refuse them as ATen does)."""
    return all(t.dtype == _BF16 for t in tensors)


def _rounded(out_shape: tuple[int, ...], compute) -> torch.Tensor:
    wide = torch.empty(out_shape, dtype=torch.float32)
    compute(wide)
    return wide.to(_BF16)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], b.shape[1])
    if not _wide(a, b):
        return aten.mm.out(a, b, out=torch.empty(shape, dtype=a.dtype))
    return _rounded(shape, lambda o: aten.mm.out(a.float(), b.float(), out=o))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not _wide(a, b):
        return aten.bmm.out(a, b, out=torch.empty(shape, dtype=a.dtype))
    return _rounded(shape, lambda o: aten.bmm.out(a.float(), b.float(), out=o))


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    shape = (a.shape[0], b.shape[1])
    if not _wide(c, a, b):
        return aten.addmm.out(c, a, b, beta=beta, alpha=alpha, out=torch.empty(shape, dtype=a.dtype))
    return _rounded(shape, lambda o: aten.addmm.out(c.float(), a.float(), b.float(), beta=beta, alpha=alpha, out=o))


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not _wide(c, a, b):
        return aten.baddbmm.out(c, a, b, beta=beta, alpha=alpha, out=torch.empty(shape, dtype=a.dtype))
    return _rounded(shape, lambda o: aten.baddbmm.out(c.float(), a.float(), b.float(), beta=beta, alpha=alpha,
                                                      out=o))


with warnings.catch_warnings():  # torch says, once, that a kernel is overridden: that is the point
    warnings.simplefilter("ignore", UserWarning)
    for _name, _kernel in (("mm", _mm), ("bmm", _bmm), ("addmm", _addmm), ("baddbmm", _baddbmm)):
        _LIB.impl(_name, _kernel, "CPU")
