"""The decoder's RMSNorms through torch's `F.rms_norm`: on CUDA one fused kernel forward and one backward, where
transformers' eager norm issues eight forward (upcast, pow, mean, add, rsqrt, mul, cast, weight) and about a dozen
backward, twice per layer per micro-batch, and again in each checkpointed recompute.

The arithmetic is transformers' Llama norm: the input upcast to fp32, normalised there (rsqrt of the mean square
plus eps), cast back to the input's dtype, then multiplied by the weight in that dtype. F.rms_norm on the fp32
upcast without a weight is that normalisation (off CUDA, the same operations: bit-identical); the weight product
stays outside it, in the input's dtype, as transformers does it. What autograd saves is the same: the fp32 upcast
and the (tokens, 1) rstd.

Which norms: those whose class's forward is, word for word, transformers' Llama RMSNorm forward (Llama, Mistral,
Qwen2/3 and their q/k norms, ...). A norm computed otherwise (Gemma's `1 + weight`, in fp32) keeps its own. The
module keeps its class's name in the tree (a subclass), its `weight` parameter and its state_dict keys.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn


def _forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(dtype)


@functools.cache
def _reference_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


@functools.cache
def _computes_like_llama(cls: type) -> bool:
    try:
        return inspect.getsource(cls.forward) == _reference_source()
    except (OSError, TypeError):  # no source to read: keep the class's own forward
        return False


@functools.cache
def _fused_class(cls: type) -> type:
    return type(cls.__name__, (cls,), {"forward": _forward, "__module__": __name__})


def use_fused_rms_norm(model: nn.Module) -> list[nn.Module]:
    """Route each Llama-style RMSNorm of `model` through F.rms_norm (its class becomes a subclass with this
    module's forward); returns the modules changed."""
    changed = []
    for m in model.modules():
        cls = type(m)
        if (cls.__module__ != __name__ and isinstance(getattr(m, "weight", None), torch.Tensor)
                and hasattr(m, "variance_epsilon") and _computes_like_llama(cls)):
            m.__class__ = _fused_class(cls)
            changed.append(m)
    return changed
