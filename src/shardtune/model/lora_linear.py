"""A LoRA Linear as one autograd Function: the frozen base's matmul and the adapter branch together, in the
compute dtype, with the fewest kernels (the launches a host-bound step scales with).

peft's `lora.Linear` runs `base(x)` and then `(result + lora_B(lora_A(dropout(x.to(fp32)))) * scaling).to(dtype)`:
7 kernels forward (two activation-sized casts, a scale, an fp32 sum) and 10 backward, and it saves an fp32 copy of
the input per adapted module (q, k and v each keep their own). `LoraLinearFunction` computes

  forward   y = x W^T (+ bias);  u = x_a A^T;  y += scaling · u B^T          (x_a = dropout(x), else x)
  backward  gu = g B;  grad_x = g W + scaling · gu A;  grad_B = scaling · g^T u;  grad_A = scaling · gu^T x_a

with A and B cast to the input's dtype (the compute dtype: the frozen base's, bf16 in a bf16 run; no cast in fp32)
once per optimizer step for a whole decoder layer in one multi-tensor kernel (`compute_adapters`): 3 kernels
forward (two matmuls, one addmm), 7 backward (four matmuls, the two adapter gradients' casts back to fp32 by
autograd), 5 where the layer's block sums its adapters' gradients (model/lora_grads.py: one kernel a block instead
of the casts and autograd's accumulation). Each scaling rides in an addmm's alpha, never a kernel of its own. It
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

from shardtune.model.lora_grads import GradSlot, make_blocks, slot_for

ADAPTER = "default"


class LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, scaling: float, x_adapter: torch.Tensor | None, ac: torch.Tensor,
                bc: torch.Tensor, grad_slot: GradSlot | None = None) -> torch.Tensor:
        """`a` (r, in), `b` (out, r): the adapters (for their gradients); `ac`, `bc`: them in x's dtype (the same
        tensors when they are in it already; else copies that `compute_adapters` keeps for the whole step);
        `grad_slot`: where backward writes A's and B's gradients instead of handing them to autograd
        (model/lora_grads.py)."""
        out, x2, xa2, u = _lora_linear(x, weight, bias, scaling, x_adapter, ac, bc)
        need_x, need_w, _, need_a, need_b, _, need_xa = ctx.needs_input_grad[:7]
        # ac and bc saved too, not kept on ctx: where they are cast afresh in every forward (FSDP2 unshards the
        # adapters into new storages each time, so compute_adapters' key never matches) a checkpointed block's
        # copies would otherwise stay alive from its forward to its backward
        ctx.save_for_backward(weight if need_x else None, x2 if need_w else None,
                              xa2 if need_a else None, u if need_b else None, ac, bc)
        ctx.scaling, ctx.x_shape, ctx.has_x_adapter, ctx.grad_slot = scaling, x.shape, x_adapter is not None, grad_slot
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
        slot = ctx.grad_slot
        if slot is not None:  # into the block's staging buffer, summed into .grad there; autograd gets none
            out_a, out_b = slot.outputs(g.dtype, g.device)
            torch.addmm(_no_input(g), g.t(), u, beta=0, alpha=s, out=out_b)
            torch.addmm(_no_input(gu), gu.t(), xa2, beta=0, alpha=s, out=out_a)
            slot.done()
            need_a = need_b = False
        if need_b:  # beta=0: the input is ignored (not read), so the product is scaled in the GEMM, no extra kernel
            grad_b = torch.addmm(_no_input(g), g.t(), u, beta=0, alpha=s)
        if need_a:
            grad_a = torch.addmm(_no_input(gu), gu.t(), xa2, beta=0, alpha=s)
        if need_w:  # not under LoRA (the base is frozen); kept so the Function is right whatever it is given
            grad_w = g.t() @ x2
        if need_bias:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, grad_xa, None, None, None


def _lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: float,
                 x_adapter: torch.Tensor | None, ac: torch.Tensor,
                 bc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's arithmetic: (output, x and the adapter's input as 2-D, u)."""
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
    return out, x2, xa2, u


_NO_INPUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _no_input(like: torch.Tensor) -> torch.Tensor:
    """addmm's input when beta=0: a 0-d tensor that broadcasts to any output (never read, so one per dtype and
    device serves every call: no allocation per GEMM either)."""
    key = (like.dtype, like.device)
    t = _NO_INPUT.get(key)
    if t is None:
        t = _NO_INPUT[key] = like.new_empty(())
    return t


# The checks below run per adapted Linear per forward: host time a host-bound step scales with. They read the
# modules' dicts directly (nn.Module.__getattr__ and peft's properties cost several times more).
def covers(layer: nn.Module) -> bool:
    """Whether `layer` (a peft lora.Linear) computes through LoraLinearFunction: one vanilla adapter without bias,
    over a plain nn.Linear weight (not transposed, not a tensor subclass)."""
    mods = layer._modules
    la = mods["lora_A"]._modules
    if len(la) != 1 or ADAPTER not in la or layer.lora_variant or getattr(layer, "fan_in_fan_out", False):
        return False
    if la[ADAPTER]._parameters.get("bias") is not None or \
            mods["lora_B"]._modules[ADAPTER]._parameters.get("bias") is not None:
        return False
    return isinstance(mods["base_layer"], nn.Linear) and \
        isinstance(mods["lora_dropout"]._modules[ADAPTER], (nn.Identity, nn.Dropout))


def _runs_fused(layer: nn.Module) -> bool:
    """Whether `layer`'s forward (bar extra arguments) computes through LoraLinearFunction now. False while its base
    weight is not there (an engine unit not gathered)."""
    # peft's disable_adapters, merged and active_adapters properties, read from the attributes behind them
    return (not layer._disable_adapters and not layer.merged_adapters and layer._active_adapter in (ADAPTER, [ADAPTER])
            and type(getattr(layer._modules["base_layer"], "weight", None)) in (torch.Tensor, nn.Parameter)
            and covers(layer))


def _adapters(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    mods = layer._modules
    return mods["lora_A"]._modules[ADAPTER].weight, mods["lora_B"]._modules[ADAPTER].weight


def _forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if args or kwargs or not _runs_fused(self):
        return _peft_forward(self)(x, *args, **kwargs)
    base = self._modules["base_layer"]
    drop = self._modules["lora_dropout"]._modules[ADAPTER]
    x_adapter = drop(x) if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0 else None
    a, b = _adapters(self)
    scaling, cast = float(self.scaling[ADAPTER]), compute_adapters(self, a, b, x.dtype)
    if not torch.is_grad_enabled():
        # No graph to record (a checkpointed unit's forward: engine/checkpointing.py; eval): the same arithmetic
        # without the Function's bookkeeping, host time every adapted Linear of every forward pays
        return _lora_linear(x, base.weight, base.bias, scaling, x_adapter, *cast)[0]
    return LoraLinearFunction.apply(x, base.weight, base.bias, a, b, scaling, x_adapter, *cast,
                                    slot_for(self, a, b, x))


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
    key = _key(a, b, dtype)
    held = layer.__dict__.get(_HELD)
    if held is None or not _same(held[0], key):
        _cast_stale(layer.__dict__.get(_BLOCK_LAYERS, [layer]), dtype)
        held = layer.__dict__[_HELD]
    return held[1], held[2]


def _key(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[Any, ...]:
    return (a.untyped_storage(), a._version, b.untyped_storage(), b._version, dtype, _optimizer_steps[0])


def _cast_stale(layers: list[nn.Module], dtype: torch.dtype) -> None:
    """New compute-dtype copies for every layer of the block (`_BLOCK_LAYERS`) whose copies are stale (after an
    optimizer step: all of them), in one multi-tensor copy (`_foreach_copy_` converts fp32 -> bf16 in its one fused
    launch on CUDA), not two kernels per layer. Only layers that compute through the Function now (a quantized base
    takes another path and needs no copies; the engine's units bind a base weight only while gathered: a block's
    layers are, together) and the stale copies are dropped first: old and new are never both held."""
    dst, src = [], []
    for layer in layers:
        if not _runs_fused(layer):
            continue
        a, b = _adapters(layer)
        if a.dtype == dtype and b.dtype == dtype:
            continue
        key = _key(a, b, dtype)
        held = layer.__dict__.pop(_HELD, None)
        if held is not None and _same(held[0], key):
            layer.__dict__[_HELD] = held
            continue
        ac, bc = torch.empty_like(a, dtype=dtype), torch.empty_like(b, dtype=dtype)
        layer.__dict__[_HELD] = (key, ac, bc)
        dst += [ac, bc]
        src += [a.detach(), b.detach()]
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


def _same(held: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    return (held[0]._cdata == key[0]._cdata and held[1] == key[1] and held[2]._cdata == key[2]._cdata
            and held[3] == key[3] and held[4] == key[4] and held[5] == key[5])


_HELD = "_compute_adapters"  # a layer's (key, A, B in the compute dtype), in its __dict__
_BLOCK_LAYERS = "_fused_lora_block"  # the fused layers of the layer's block (one list object), in its __dict__
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
    changed = [(n, m) for n, m in model.named_modules() if type(m) is Linear]
    blocks: dict[str, list[nn.Module]] = {}
    for name, m in changed:
        m.__class__ = cls
        # compute_adapters casts a block's at once: the layers under one entry of a ModuleList (a decoder layer)
        parts = name.split(".")
        index = max((i for i, part in enumerate(parts) if part.isdigit()), default=len(parts) - 1)
        m.__dict__[_BLOCK_LAYERS] = blocks.setdefault(".".join(parts[:index + 1]), [])
        m.__dict__[_BLOCK_LAYERS].append(m)
    make_blocks(changed, _adapters)
    return [m for _, m in changed]
