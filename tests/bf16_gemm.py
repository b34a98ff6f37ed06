"""bf16 matrix products and attention on this suite's CPUs as a GPU computes them, at fp32 speed: inputs widened
to fp32 (exact), one fp32 GEMM (fp32 accumulation), the result rounded to bf16 once. Imported by the rank server
(tests/ranks.py), so every forked rank has it; CLI runs keep torch's own kernels.

Why: on a CPU without AVX-512 BF16 (these 2-core AMD machines: AVX2 only), ATen's bf16 GEMM is a scalar fallback,
~10x slower than the fp32 GEMM on the same shapes (a 512x256 by 256x688 product: 29 ms against 2.8 ms widened), and
the suite's bf16 runs spent most of their time there. The arithmetic is the same: ATen's fallback also widens each
product and accumulates in fp32 before rounding once (cuBLAS's bf16 GEMM does too); only the order of the sums may
differ. Registered for the CPU dispatch key below autograd and below any TorchDispatchMode, so what a memory
tracker sees (the op and its bf16 output) is unchanged; the fp32 temporaries live inside the kernel, as ATen's own
workspace would. Other dtypes go to the same ops' `.out` kernels, which are untouched.

SDPA's CPU flash-attention kernels (forward and backward) and the experts' `_grouped_mm` likewise. In bf16 on
these CPUs the attention backward of a causal 2,900-token document (4 heads of 32) takes 0.98 s against 0.16 s
widened, and a grouped product of 1,024 rows by 8 experts of 256x512 206 ms against 5.4 ms in fp32; they dominated
the bf16 rows of the plan-accuracy test. Those ops have no `.out` overload through which a replacement could reach
the original kernel, so these are registered one dispatch key higher, at BackendSelect (below autograd and any
TorchDispatchMode, above every backend; always in the dispatch key set): bf16 CPU inputs are widened and redispatched
to the CPU kernel, the results rounded once (as the bf16 kernel's fp32 accumulation does, except that it rounds the
attention probabilities to bf16 before the product with V, which here they are not); any other dtype or device
(meta, on the simulated GPU's ranks) goes on to its own kernel unchanged.
"""
from __future__ import annotations

import warnings

import torch

aten = torch.ops.aten
_LIB = torch.library.Library("aten", "IMPL")
_BF16 = torch.bfloat16


def _wide(*tensors: torch.Tensor) -> bool:
    """All bf16: the products to widen (mixed dtypes go to the `.out` kernels, which refuse them as ATen does)."""
    return all(t.dtype is _BF16 for t in tensors)


# The products below see every CPU matmul of a forked rank, fp32 ones too (most of them): those take the shortest
# path to the untouched kernel, one `torch.<op>(..., out=)` call (~10 us over the native call on a small product).
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _wide(a, b):
        return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1])))
    return torch.mm(a.float(), b.float()).to(_BF16)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _wide(a, b):
        return torch.bmm(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))
    return torch.bmm(a.float(), b.float()).to(_BF16)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if not _wide(c, a, b):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], b.shape[1])))
    return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(_BF16)


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if not _wide(c, a, b):
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))
    return torch.baddbmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(_BF16)


_AFTER_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_GROUPED_MM = aten._grouped_mm.default


def _below(*tensors: torch.Tensor) -> torch._C.DispatchKeySet:
    """The dispatch keys after BackendSelect of these tensors: where the call goes on to."""
    keys = torch._C._dispatch_keys(tensors[0])
    for t in tensors[1:]:
        keys = keys | torch._C._dispatch_keys(t)
    return keys & _AFTER_BACKEND_SELECT


def _cpu_bf16(*tensors: torch.Tensor | None) -> bool:
    present = [t for t in tensors if t is not None]
    return all(t.device.type == "cpu" for t in present) and _wide(*present)


def _wider(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _flash(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if not _cpu_bf16(q, k, v, attn_mask):
        return _FLASH.redispatch(_below(q, k, v), q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out, logsumexp = _FLASH.redispatch(_below(q, k, v), q.float(), k.float(), v.float(), dropout_p, is_causal,
                                       attn_mask=_wider(attn_mask), scale=scale)
    return out.to(_BF16), logsumexp  # logsumexp is fp32 for bf16 inputs too


def _flash_backward(grad, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    keys = _below(grad, q, k, v, out)
    if not _cpu_bf16(grad, q, k, v, out, attn_mask):
        return _FLASH_BACKWARD.redispatch(keys, grad, q, k, v, out, logsumexp, dropout_p, is_causal,
                                          attn_mask=attn_mask, scale=scale)
    grads = _FLASH_BACKWARD.redispatch(keys, *(t.float() for t in (grad, q, k, v, out)), logsumexp, dropout_p,
                                       is_causal, attn_mask=_wider(attn_mask), scale=scale)
    return tuple(g.to(_BF16) for g in grads)


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    keys = _below(a, b)
    if not _cpu_bf16(a, b, bias) or out_dtype not in (None, _BF16):
        return _GROUPED_MM.redispatch(keys, a, b, offs=offs, bias=bias, out_dtype=out_dtype)
    return _GROUPED_MM.redispatch(keys, a.float(), b.float(), offs=offs, bias=_wider(bias)).to(_BF16)


with warnings.catch_warnings():  # torch says, once, that a kernel is overridden: that is the point
    warnings.simplefilter("ignore", UserWarning)
    for _name, _kernel in (("mm", _mm), ("bmm", _bmm), ("addmm", _addmm), ("baddbmm", _baddbmm)):
        _LIB.impl(_name, _kernel, "CPU")
    _LIB.impl("_scaled_dot_product_flash_attention_for_cpu", _flash, "BackendSelect")
    _LIB.impl("_scaled_dot_product_flash_attention_for_cpu_backward", _flash_backward, "BackendSelect")
    _LIB.impl("_grouped_mm", _grouped_mm, "BackendSelect")
