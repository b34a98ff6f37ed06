"""A LoRA Linear as one autograd Function: the frozen base's matmul and the adapter branch together, in the
compute dtype, with the fewest kernels (the launches a host-bound step scales with).

peft's `lora.Linear` runs `base(x)` and then `(result + lora_B(lora_A(dropout(x.to(fp32)))) * scaling).to(dtype)`:
7 kernels forward (two activation-sized casts, a scale, an fp32 sum) and 10 backward, and it saves an fp32 copy of
the input per adapted module (q, k and v each keep their own). `LoraLinearFunction` computes

  forward   y = x W^T (+ bias);  u = x_a A^T;  y += scaling · u B^T          (x_a = dropout(x), else x)
  backward  gu = g B;  grad_x = g W + scaling · gu A;  grad_B = scaling · g^T u;  grad_A = scaling · gu^T x_a

with A and B cast to the input's dtype (the compute dtype: the frozen base's, bf16 in a bf16 run; no cast in fp32)
once per optimizer step (`compute_adapters`): 3 kernels forward (two matmuls, one addmm), 7 backward (four
matmuls, the two adapter gradients' casts back to fp32 by autograd). Each scaling rides in an addmm's alpha, never a kernel of its own. It
saves the input as given (shared by every module reading it), u (b·s x r) and the r-wide casts; no gradient for
the frozen weight. In fp32 the arithmetic is peft's (the same products; sums in another order: equal to fp32
rounding). In bf16 the adapter runs in bf16 like FSDP2's (which casts the adapters with every parameter), where
peft runs it in fp32.

`FusedLoraLinear` is peft's `lora.Linear` with this forward (`use_fused_lora` swaps the class of the modules peft
made): the module tree, parameter names, merging and peft's save/load format are peft's. Any layer this Function
does not cover (several or mixed adapters, DoRA and other variants, merged, adapters off, biased adapters, a base
weight that is a tensor subclass such as QLoRA's NF4 weight, which computes through its own Function in
engine/nf4_linear.py) takes peft's forward.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

ADAPTER = "default"


class LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, scaling: float, x_adapter: torch.Tensor | None, ac: torch.Tensor,
                bc: torch.Tensor) -> torch.Tensor:
        """`a` (r, in), `b` (out, r): the adapters (for their gradients); `ac`, `bc`: them in x's dtype (the same
        tensors when they are in it already; else copies that `compute_adapters` keeps for the whole step)."""
        in_f, out_f = weight.shape[1], weight.shape[0]
        x2 = x.reshape(-1, in_f)
        xa2 = x2 if x_adapter is None else x_adapter.reshape(-1, in_f)
        # Allocated in the output's shape and returned as is (not a view): a reader may write it in place
        # (chunked_lora.LoraDelta, when a module routes around this class, does so with the base's output).
        out = torch.empty(*x.shape[:-1], out_f, dtype=x.dtype, device=x.device)
        y = out.view(-1, out_f)
        if bias is None:
            torch.mm(x2, weight.t(), out=y)
        else:
            torch.addmm(bias, x2, weight.t(), out=y)
        u = xa2 @ ac.t()  # (tokens, r)
        y.addmm_(u, bc.t(), alpha=scaling)
        need_x, need_w, _, need_a, need_b, _, need_xa = ctx.needs_input_grad[:7]
        ctx.save_for_backward(weight if need_x else None, x2 if need_w else None,
                              xa2 if need_a else None, u if need_b else None, ac, bc)
        ctx.scaling, ctx.x_shape, ctx.has_x_adapter = scaling, x.shape, x_adapter is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        weight, x2, xa2, u, ac, bc = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b, _, need_xa = ctx.needs_input_grad[:7]
        s = ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_bias = grad_a = grad_b = grad_xa = None
        gu = g @ bc if (need_x or need_a or need_xa) else None  # (tokens, r)
        if need_x:
            grad_x = g @ weight
            if not ctx.has_x_adapter:  # the adapter read x itself: its share joins grad_x in the same kernel
                grad_x.addmm_(gu, ac, alpha=s)
            grad_x = grad_x.view(ctx.x_shape)
        if need_xa:
            grad_xa = torch.addmm(_no_input(gu), gu, ac, beta=0, alpha=s).view(ctx.x_shape)
        if need_b:  # beta=0: the input is ignored (not read), so the product is scaled in the GEMM, no extra kernel
            grad_b = torch.addmm(_no_input(g), g.t(), u, beta=0, alpha=s)
        if need_a:
            grad_a = torch.addmm(_no_input(gu), gu.t(), xa2, beta=0, alpha=s)
        if need_w:  # not under LoRA (the base is frozen); kept so the Function is right whatever it is given
            grad_w = g.t() @ x2
        if need_bias:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, grad_xa, None, None


def _no_input(like: torch.Tensor) -> torch.Tensor:
    """addmm's input when beta=0: a 0-d tensor that broadcasts to any output (an allocation, no kernel)."""
    return like.new_empty(())


def covers(layer: nn.Module) -> bool:
    """Whether `layer` (a peft lora.Linear) computes through LoraLinearFunction: one vanilla adapter without bias,
    over a plain nn.Linear weight (not transposed, not a tensor subclass)."""
    if list(layer.lora_A) != [ADAPTER] or layer.lora_variant or getattr(layer, "fan_in_fan_out", False):
        return False
    if layer.lora_A[ADAPTER].bias is not None or layer.lora_B[ADAPTER].bias is not None:
        return False
    drop = layer.lora_dropout[ADAPTER]
    return isinstance(layer.get_base_layer(), nn.Linear) and isinstance(drop, (nn.Identity, nn.Dropout))


def _forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    base = self.base_layer
    weight = base.weight
    if (args or kwargs or self.disable_adapters or self.merged or list(self.active_adapters) != [ADAPTER]
            or type(weight) not in (torch.Tensor, nn.Parameter) or not covers(self)):
        return _peft_forward(self)(x, *args, **kwargs)
    drop = self.lora_dropout[ADAPTER]
    x_adapter = drop(x) if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0 else None
    a, b = self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight
    return LoraLinearFunction.apply(x, weight, base.bias, a, b, float(self.scaling[ADAPTER]), x_adapter,
                                    *compute_adapters(self, a, b, x.dtype))


def compute_adapters(layer: nn.Module, a: torch.Tensor, b: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B in the compute dtype, cast once per optimizer step rather than in every forward and recompute (two
    kernels each time: 4 per micro-batch under checkpointing). The copies are kept while A and B are unchanged: the
    same storages (held here, so none can be freed and its address reused) at the same versions (an in-place write
    through the tensor or a view bumps it; a load into them included) and no optimizer step since. The step count is
    in the key because a version is not enough: the fused AdamW kernel (the CPU's, train.build_optimizer) writes the
    parameters without bumping their versions, and the copies went stale from the first step on.
    r·(in + out) elements in the compute dtype."""
    if a.dtype == dtype and b.dtype == dtype:
        return a, b
    key = (a.untyped_storage(), a._version, b.untyped_storage(), b._version, dtype, _optimizer_steps[0])
    held = layer.__dict__.get("_compute_adapters")
    if held is None or not _same(held[0], key):
        with torch.no_grad():
            held = layer.__dict__["_compute_adapters"] = (key, a.detach().to(dtype), b.detach().to(dtype))
    return held[1], held[2]


def _same(held: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    return (held[0]._cdata == key[0]._cdata and held[1] == key[1] and held[2]._cdata == key[2]._cdata
            and held[3] == key[3] and held[4] == key[4] and held[5] == key[5])


_optimizer_steps = [0]  # optimizer steps taken in this process, by any optimizer (compute_adapters' key)


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _optimizer_steps[0] += 1


@functools.cache
def fused_class() -> type:
    """peft's lora.Linear with `_forward` (made on first use: peft is imported only by runs with LoRA)."""
    from peft.tuners.lora import Linear

    register_optimizer_step_post_hook(_count_step)  # once: this function is cached
    return type("FusedLoraLinear", (Linear,), {"forward": _forward, "__module__": __name__})


def _peft_forward(layer: nn.Module) -> Any:
    return functools.partial(fused_class().__mro__[1].forward, layer)


def use_fused_lora(model: nn.Module) -> list[nn.Module]:
    """Give each peft lora.Linear of `model` this module's forward (its class becomes FusedLoraLinear, a subclass:
    isinstance checks, parameter names and state_dict keys are unchanged); returns the modules changed."""
    from peft.tuners.lora import Linear

    cls = fused_class()
    changed = []
    for m in model.modules():
        if type(m) is Linear:
            m.__class__ = cls
            changed.append(m)
    return changed
