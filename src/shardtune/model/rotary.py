"""Rotary position embedding of a layer's queries and keys in one autograd Function: 6 kernels forward and 6
backward for q and k together, where transformers' `apply_rotary_pos_emb` issues 10 forward (per tensor: two
products, a negation, a concatenation, a sum) and about 14 backward (products, negations, zero-padded slice
gradients, sums), per layer per micro-batch and again in each checkpointed recompute.

transformers computes x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1] (x1, x2 the halves of head_dim).
Here q and k are laid side by side once ([b, s, heads_q + heads_kv, d]: one concatenation, the layout the
projections wrote), then for all their heads at once

  forward   y = x·cos;  y1 -= x2·sin1;  y2 += x1·sin2
  backward  gx = g·cos;  gx1 += g2·sin2;  gx2 -= g1·sin1

the same products and sums as transformers' forward and autograd's backward (a - b is a + (-b) exactly; the
zero halves autograd adds are exact): bit-identical in fp32 and bf16. q and k come back as views of the one
output, in the [b, s, heads, d] layout the attention reads (no copy before the flash kernels).

Which layers: an attention whose forward calls its module's `apply_rotary_pos_emb`, where that function and its
`rotate_half` are, word for word, transformers' Llama ones (Llama, Mistral, Qwen2/3, ...). The module becomes a
subclass whose forward is its class's own code, with that one name resolved to `apply_rotary` (no library module
is changed); its name, parameters and state_dict keys are unchanged. Anything else keeps its own rotary.
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

_NAME = "apply_rotary_pos_emb"


class _RotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, hq, s, d], k [b, hk, s, d], cos/sin [b or 1, s, d] -> the rotated q and k (views of one output)."""
        x = torch.cat((q.transpose(1, 2), k.transpose(1, 2)), dim=2)  # [b, s, hq + hk, d]
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        half = x.shape[-1] // 2
        y = x * c
        # The rolled product a half at a time, each freed before the next: at most x, y and half of one alive
        # (a whole roll(x) and its product would hold two more tensors of q and k's size: at 128k tokens on 8B,
        # 2.7 GB). (Not `y[...] -= p`: its setitem is one more copy_ kernel.)
        y[..., :half].sub_(x[..., half:] * s[..., :half])
        y[..., half:].add_(x[..., :half] * s[..., half:])
        del x
        ctx.save_for_backward(cos, sin)
        ctx.heads_q = q.shape[1]
        y = y.transpose(1, 2)
        return y[:, :ctx.heads_q], y[:, ctx.heads_q:]

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[Any, ...]:
        cos, sin = ctx.saved_tensors
        g = torch.cat((grad_q.transpose(1, 2), grad_k.transpose(1, 2)), dim=2)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        half = g.shape[-1] // 2
        gx = g * c
        gx[..., :half].add_(g[..., half:] * s[..., half:])  # roll(g·sin) a half at a time, as in forward
        gx[..., half:].sub_(g[..., :half] * s[..., :half])
        del g
        gx = gx.transpose(1, 2)
        return gx[:, :ctx.heads_q], gx[:, ctx.heads_q:], None, None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama `apply_rotary_pos_emb`, same arguments and result, through `_RotaryQK`. What the
    Function does not cover (other layouts, a cos/sin of another dtype, which transformers would promote to, or one
    that needs a gradient) takes transformers' own."""
    if (unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1]
            or q.shape[-1] % 2 or len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1
            or cos.requires_grad or sin.requires_grad):
        return _llama_functions()[0](q, k, cos, sin, unsqueeze_dim)
    return _RotaryQK.apply(q, k, cos, sin)


@functools.cache
def _llama_functions() -> tuple[Any, Any]:
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb, modeling_llama.rotate_half


@functools.cache
def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):  # no source to read: not known to compute like Llama's
        return None


def _computes_like_llama(module_globals: dict[str, Any]) -> bool:
    return all(_source(module_globals.get(name)) is not None
               and _source(module_globals.get(name)) == _source(ref)
               for name, ref in zip((_NAME, "rotate_half"), _llama_functions(), strict=True))


@functools.cache
def _fused_class(cls: type) -> type:
    forward = cls.forward
    scope = {**forward.__globals__, _NAME: apply_rotary}
    fused = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__,
                               forward.__closure__)
    fused.__kwdefaults__, fused.__qualname__ = forward.__kwdefaults__, forward.__qualname__
    return type(cls.__name__, (cls,), {"forward": fused, "__module__": __name__})


@functools.cache
def _applies(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    return (isinstance(forward, types.FunctionType) and cls.__module__ != __name__
            and _NAME in forward.__code__.co_names and _computes_like_llama(forward.__globals__))


def use_fused_rotary(model: nn.Module) -> list[nn.Module]:
    """Give each attention of `model` that applies Llama's rotary `apply_rotary` (module docstring); returns the
    modules changed."""
    changed = []
    for m in model.modules():
        if _applies(type(m)):
            m.__class__ = _fused_class(type(m))
            changed.append(m)
    return changed


def fused_in(model: nn.Module) -> bool:
    """Whether `model`'s attentions rotate q and k through `_RotaryQK` (swapped in already, or would be): their rotated
    q and k are views of one tensor, so either one saved keeps both alive (the plan reads it: plan/estimate.py, on
    HF's meta model or plan/skeleton.py's, whose attentions say so)."""
    return any(type(m).__module__ == __name__ or getattr(type(m), "ROTATES_LIKE_LLAMA", False) or _applies(type(m))
               for m in model.modules())
