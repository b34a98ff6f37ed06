"""A LoRA Linear's adapter branch over chunks of the sequence, with nothing of b·s·(in or out) width saved in fp32.

peft computes `(base(x) + lora_B(lora_A(x.to(fp32))) * scaling).to(x.dtype)` under bf16 compute: it saves the fp32
cast of the input (b·s·in·4 B, one per adapted module: q, k and v each keep their own copy of the same input) and,
in every forward and recompute, makes three b·s·out fp32 transients (lora_B's output, its scaled copy, the sum).
At 128k tokens on Llama-3.1-8B that is 8 GiB saved per layer for q, k, v, o alone.

`LoraDelta` is the same arithmetic, chunk by chunk of the sequence, in one autograd Function:
  forward   out[c] = (result[c] + (x[c].to(fp32) @ A^T) @ B^T * scaling).to(result.dtype)
  backward  g = grad_out.to(fp32) * scaling; grad_B = sum_c g[c]^T u[c]; gu = g @ B;
            grad_A = sum_c gu[c]^T x[c].to(fp32); grad_x[c] = (gu[c] @ A).to(x.dtype); grad_result = grad_out
It saves `x` as given (the base's input, shared by every module reading it) and u = x @ A^T (b·s·r fp32); every
fp32 intermediate is one chunk wide. The elementwise operations and their dtypes are peft's (the same cast, the
same product, the same sum rounded once), so each output element equals peft's; the weight gradients are sums
over chunks (another order of the same fp32 sum: equal within rounding). grad_result is exact: autograd's is
grad_out cast to fp32 and back. Applied only where it is the same computation: one active vanilla adapter, no
dropout, not merged (`apply_chunked_lora`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

ADAPTER = "default"


class LoraDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, result: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scaling: float, chunk_tokens: int) -> torch.Tensor:
        x2, r2 = x.reshape(-1, x.shape[-1]), result.reshape(-1, result.shape[-1])
        # The sum is written over the base's output (a temporary nothing saves: the base is frozen), so no second
        # b·s·out tensor exists: 1 GiB for q_proj at 128k tokens on an 8B model. mark_dirty: autograd checks it.
        # A view (a base layer whose own Function returned one) cannot be marked dirty: it gets its own output.
        if result.is_contiguous() and not result._is_view():
            ctx.mark_dirty(result)
            out = result
        else:
            out = torch.empty(result.shape, dtype=result.dtype, device=result.device)
        o2 = out.view(-1, out.shape[-1])
        u = torch.empty(x2.shape[0], a.shape[0], dtype=a.dtype, device=x.device)  # (tokens, r), adapters' dtype
        for t0 in range(0, x2.shape[0], chunk_tokens):
            t = slice(t0, t0 + chunk_tokens)
            torch.mm(x2[t].to(a.dtype), a.t(), out=u[t])
            o2[t] = r2[t] + (u[t] @ b.t()) * scaling
        ctx.save_for_backward(x, u, a, b)
        ctx.scaling, ctx.chunk_tokens = scaling, chunk_tokens
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, u, a, b = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        need_x, need_r, need_a, need_b = ctx.needs_input_grad[:4]
        grad_x = torch.empty_like(x2) if need_x else None
        grad_a = torch.zeros_like(a) if need_a else None
        grad_b = torch.zeros_like(b) if need_b else None
        for t0 in range(0, x2.shape[0], ctx.chunk_tokens):
            t = slice(t0, t0 + ctx.chunk_tokens)
            g = g2[t].to(b.dtype) * ctx.scaling
            if need_b:
                grad_b.add_(g.t() @ u[t])
            gu = g @ b
            if need_a:
                grad_a.add_(gu.t() @ x2[t].to(a.dtype))
            if need_x:
                grad_x[t] = gu @ a
        return (grad_x.view(x.shape) if need_x else None, grad_out if need_r else None, grad_a, grad_b, None, None)


def _forward(layer: nn.Module, original: Any, chunk_tokens: int, x: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
    if (layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None
            or list(layer.active_adapters) != [ADAPTER] or not torch.is_grad_enabled()):
        return original(x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    return LoraDelta.apply(x, result, a, b, float(layer.scaling[ADAPTER]), chunk_tokens)


def apply_chunked_lora(units: list[nn.Module], *, chunk_tokens: int) -> list[nn.Module]:
    """Route each vanilla peft LoRA Linear of `units` (one adapter, no dropout, no bias on A/B) through LoraDelta;
    returns the layers changed. Any other layer keeps peft's forward."""
    if not any(hasattr(m, "lora_A") for u in units for m in u.modules()):
        return []  # no adapters: peft is not imported (~0.4 s per worker)
    from peft.tuners.lora import Linear as LoraLinear

    changed = []
    for unit in units:
        for m in unit.modules():
            if not isinstance(m, LoraLinear) or list(m.lora_A) != [ADAPTER] or m.lora_variant:
                continue
            if not isinstance(m.lora_dropout[ADAPTER], nn.Identity) or m.lora_A[ADAPTER].bias is not None \
                    or m.lora_B[ADAPTER].bias is not None:
                continue
            m.forward = functools.partial(_forward, m, m.forward, chunk_tokens)
            changed.append(m)
    return changed
