"""LoRA adapter gradients summed outside autograd, a block at a time: the kernels a micro-batch issues for them do
not scale with the number of adapters.

Through autograd, each adapted Linear's backward (model/lora_linear.py) hands its A and B gradients in the compute
dtype; autograd casts each to the fp32 parameter's dtype (a kernel each) and, from the second micro-batch of a step
on, adds it into `.grad` (another): 4 kernels per adapted Linear per micro-batch, 900 of an 8B LoRA step's ~11,000.
Here each Linear's backward writes its two gradients into its block's staging buffer instead (the GEMMs' `out=`: no
kernel of their own), and when every Linear of the block (the Linears under one parent module: q/k/v/o, gate/up/down)
has written, one kernel moves the buffer into the block's fp32 gradients: a copy into a flat buffer whose views
become the parameters' `.grad` on a step's first micro-batch, an add into it after. The sums are autograd's: the same
compute-dtype products, converted exactly, added in fp32 in the same order. One caveat: a GEMM written into a given
`out=` may take another kernel than one that allocates (the CPU's bf16 addmm does for some input strides), so a
product can round differently in its last bf16 bit (a 1-rank bf16 tiny-lora-cpu run: equal losses through step 3,
4.199077 against 4.199028 at step 4).

Autograd sees no gradient for these adapters, so nothing may read them from it: no tensor hook, no FSDP2 post-backward
reading `.grad` before the block's add. So it is opt-in (`take_adapter_gradients`): the engine's replicated adapters
on one rank (engine/shard.py; with more, engine/replicated.py sums them through tensor hooks), and only while no hook is
on them (checked per forward).

Memory: one block's adapter gradients in the compute dtype during its backward (a few MiB at 8B), where autograd held
one Linear's at a time plus its fp32 cast; the fp32 gradients are the same bytes, as one flat per block.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_ALIGN = 128  # elements: 256 bytes in bf16, what cuBLAS's fastest kernels want of a pointer


class GradBlock:
    """The adapters of the adapted Linears under one parent module, in order: [A0, B0, A1, B1, ...]."""

    def __init__(self, adapters: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.shapes = [tuple(p.shape) for pair in adapters for p in pair]
        # Bound by each forward that opts in (`bind`), not kept from injection: a sharding wrapper (FSDP2) replaces
        # the parameters, and holding the originals would keep them alive for the run
        self.params: list[nn.Parameter | None] = [None] * len(self.shapes)
        self.offsets, n = [], 0
        for shape in self.shapes:  # each at a multiple of _ALIGN elements: the GEMMs write into aligned outputs
            self.offsets.append(n)
            n += -(-math.prod(shape) // _ALIGN) * _ALIGN
        self.numel = n
        self.active = False  # take_adapter_gradients
        self.staging: torch.Tensor | None = None  # 1D, compute dtype, numel: this backward's gradients, not moved yet
        self.written = [False] * len(adapters)
        self.task = -1  # the autograd graph task whose end flushes what is left (a Linear that did not run)

    def bind(self, i: int, a: nn.Parameter, b: nn.Parameter) -> bool:
        """Linear i's adapters are `a` and `b` (the parameter objects of this forward: a model's load or the engine's
        move may have replaced those it had at injection); False if their sizes changed (autograd sums them)."""
        k = 2 * i
        if self.params[k] is not a or self.params[k + 1] is not b:
            if (tuple(a.shape), tuple(b.shape)) != (self.shapes[k], self.shapes[k + 1]):
                return False
            self.params[k], self.params[k + 1] = a, b
        return True

    def slot(self, i: int) -> GradSlot:
        return GradSlot(self, i)

    def outputs(self, i: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where Linear i's backward writes its A and B gradients (views of the staging buffer)."""
        task = torch._C._current_graph_task_id()
        if task != self.task:  # a new backward: drop what an aborted one left, flush what this one leaves at its end
            self.staging, self.written, self.task = None, [False] * len(self.written), task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        if self.written[i] or (self.staging is not None and self.staging.dtype != dtype):
            self.flush()  # a Linear run twice in one backward: its first gradient is moved before the second lands
        if self.staging is None:
            self.staging = torch.empty(self.numel, dtype=dtype, device=device)
        return self._view(2 * i), self._view(2 * i + 1)

    def done(self, i: int) -> None:
        self.written[i] = True
        if all(self.written):
            self.flush()

    def _view(self, k: int) -> torch.Tensor:
        shape, a = self.shapes[k], self.offsets[k]
        return self.staging[a:a + math.prod(shape)].view(shape)

    def flush(self) -> None:
        """Move the staging buffer's gradients into `.grad` (one kernel when every Linear wrote and `.grad` is this
        block's flat or none)."""
        if self.staging is None:
            return
        written = self.written
        with torch.no_grad():
            if all(written) and self._move_whole():
                pass
            else:  # some Linear did not run, or someone replaced a .grad: parameter by parameter
                for i, w in enumerate(written):
                    for k in (2 * i, 2 * i + 1):
                        if w:
                            p, g = self.params[k], self._view(k)
                            if p.grad is None:
                                p.grad = g.to(p.dtype, copy=True)
                            else:
                                p.grad.add_(g)
        self.staging, self.written = None, [False] * len(written)

    def _move_whole(self) -> bool:
        params, staging = self.params, self.staging
        grads = [p.grad for p in params]
        dtype = params[0].dtype
        if all(g is None for g in grads) and all(p.dtype == dtype for p in params):
            flat = torch.empty(self.numel, dtype=dtype, device=staging.device)
            flat.copy_(staging)
            for p, a in zip(params, self.offsets, strict=True):
                p.grad = flat[a:a + p.numel()].view(p.shape)
            return True
        flat = grads[0]._base if grads[0] is not None else None
        if flat is None or flat.numel() != self.numel or not all(
                g is not None and g._base is flat and g.storage_offset() == flat.storage_offset() + a
                for g, a in zip(grads, self.offsets, strict=True)):
            return False
        flat.add_(staging)
        return True


class GradSlot:
    """One adapted Linear's place in its block (what LoraLinearFunction is given)."""
    __slots__ = ("block", "i")

    def __init__(self, block: GradBlock, i: int) -> None:
        self.block, self.i = block, i

    def outputs(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block.outputs(self.i, dtype, device)

    def done(self) -> None:
        self.block.done(self.i)


SLOT = "_lora_grad_slot"  # the layer's GradSlot, in its __dict__


def make_blocks(named_layers: list[tuple[str, nn.Module]], adapters: Any) -> None:
    """Give each layer its slot, grouping consecutive layers under one parent module; `adapters(layer)`: (A, B)."""
    groups: list[list[nn.Module]] = []
    parent = None
    for name, layer in named_layers:
        p = name.rpartition(".")[0]
        if not groups or p != parent:
            groups.append([])
        parent = p
        groups[-1].append(layer)
    for layers in groups:
        block = GradBlock([adapters(m) for m in layers])
        for i, m in enumerate(layers):
            m.__dict__[SLOT] = block.slot(i)


def take_adapter_gradients(model: nn.Module) -> int:
    """Opt in: the fused LoRA Linears of `model` sum their adapters' gradients here, not through autograd (module
    docstring: nothing else may read them from autograd). Returns the number of blocks."""
    blocks = {id(s.block): s.block for m in model.modules() if (s := m.__dict__.get(SLOT)) is not None}
    for block in blocks.values():
        block.active = True
    return len(blocks)


def slot_for(layer: nn.Module, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> GradSlot | None:
    """The layer's slot when its gradients go through its block this forward: opted in, a backward to come, the
    adapters cast (their gradients need the conversion this saves), and no hook that expects them from autograd."""
    slot = layer.__dict__.get(SLOT)
    if (slot is None or not slot.block.active or not torch.is_grad_enabled() or a.dtype == x.dtype
            or not (a.requires_grad and b.requires_grad) or a._backward_hooks or b._backward_hooks
            or a._post_accumulate_grad_hooks or b._post_accumulate_grad_hooks):
        return None
    return slot if slot.block.bind(slot.i, a, b) else None
