"""Activation checkpointing of whole units, applied before sharding.

The unit's `forward` is replaced on the instance by a checkpointed call of the original, so the module tree and
parameter names do not change (no wrapper module) and the engine's hooks, registered on the module's `__call__`,
stay *outside* the checkpointed region: the forward pre-hook gathers the unit once, the output hook gathers it again
for backward, and the recompute (triggered inside the unit's backward, after that hook) runs on that same gathered
buffer: no extra all-gather and no hook inside recompute that could free it. Cost: one more forward of each
checkpointed unit; saving: all the unit's activations but its inputs.

Two ways to recompute, the same arithmetic:
- `recompute` (our engine's default): one autograd Function per unit. Its forward runs the unit with autograd off
  (nothing recorded, nothing saved but the unit's inputs); its backward runs the unit again with autograd on and
  back-propagates through that graph at once (a nested `torch.autograd.backward`: the parameters' gradients and
  their hooks fire in it, the inputs' gradients are returned). The host work is one forward without a graph plus one
  with: on the simulated GPU's 1B LoRA step it takes 0.68x the host CPU of the non-reentrant checkpoint below
  (bench/RESULTS.md), whose saved-tensor hooks run Python for each of a block's ~54 saved tensors twice and which
  records the forward's graph as well as the recompute's. It replays the whole unit (the non-reentrant one stops at
  the last tensor backward reads): 1 more kernel a decoder block. Its backward holds the unit's incoming gradient
  until the unit's own backward is done: one b·s·h more (plan: Setup.recomputes).
- non-reentrant `torch.utils.checkpoint` everywhere else. Recipe-wide (`engine_recomputes`): FSDP2
  (`engine.backend=torch`, run the way torchtitan runs it), compiled units (engine/compile.py runs its graph only with
  autograd on), an NF4 base (its peak under the Function is not modelled by the plan); offloaded inputs
  (offload_activations.py hooks exactly the inputs that checkpoint saves). Per unit (`replayable`): dropout (the
  non-reentrant checkpoint restores the RNG), a MoE router (RouterBalance records its outputs during the
  grad-enabled forward), an MLP and norms cut into checkpointed chunks of the sequence (`engine.mlp_chunk_tokens`,
  model/tiled_mlp.py: the non-reentrant recompute stops before them, a whole replay would run each a third time).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units


def apply_activation_checkpointing(model: nn.Module, unit_classes: tuple[type[nn.Module], ...], *,
                                   every_k: int = 1, min_unit_params: int | None = None,
                                   offloader: ActivationOffloader | None = None,
                                   recompute: bool = True) -> list[nn.Module]:
    """Checkpoint every `every_k`-th unit (units 0, k, 2k, ... in forward order); returns those modules.
    `offloader`: their kept inputs live on the host between forward and recompute (offload_activations.py).
    `recompute`: units that allow it take `recompute` (module docstring), the others torch's non-reentrant one."""
    assert every_k >= 1
    chosen = find_units(model, unit_classes, min_unit_params)[::every_k]
    for unit in chosen:
        if offloader is not None:
            unit.forward = offloader.checkpointed(unit.forward)
        elif recompute and replayable(unit):
            unit.forward = functools.partial(_recomputed, unit, unit.forward)
        else:
            unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    return chosen


def engine_recomputes(*, backend: str, compile: bool, nf4: bool) -> bool:
    """The recipe's half of the choice (module docstring), shared by trainer/parallelize.py and plan's Setup."""
    return backend == "shardtune" and not compile and not nf4


def replayable(unit: nn.Module) -> bool:
    """Whether running `unit` again gives what its forward gave, with no side effect a no-grad forward would skip:
    no dropout (active or not: a recipe may turn it on for a later phase), no MoE router, no chunks checkpointed
    inside (module docstring)."""
    from shardtune.model.router_loss import routers
    from shardtune.model.tiled_mlp import SEQUENCE_CHUNKED

    if unit.__dict__.get(SEQUENCE_CHUNKED):
        return False
    for m in unit.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return False
        if float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0:  # HF attention modules (their config's value)
            return False
    return not routers(unit)


# A leaf that requires a gradient and never gets one: given to the Function when none of a unit's inputs requires a
# gradient but its parameters do (the first decoder block of a LoRA model: frozen embeddings), so autograd still
# calls its backward.
_ANCHOR = torch.empty(0, requires_grad=True)


def _recomputed(unit: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # eval, generate, a reference model's log-probs: nothing to recompute
        return forward(*args, **kwargs)
    # The tensors among the arguments, one level deep (a decoder block's: hidden states, (cos, sin), the mask):
    # a pytree walk would also visit every int of a packed batch's document lengths, each call
    names = list(kwargs)
    values = [*args, *(kwargs[k] for k in names)]
    tensors, slots = _tensors(values)
    anchor = []
    if not any(t.requires_grad for t in tensors):
        if not any(p.requires_grad for p in unit.parameters()):
            return forward(*args, **kwargs)  # a frozen unit on frozen inputs: no backward reaches it
        anchor = [_ANCHOR]
    n_args = len(args)
    # The tensors reach the recompute only through the Function's saved tensors (freed once its backward is done),
    # never through this closure, which lives as long as the graph: a micro-step's loss still bound while the next
    # forward runs would otherwise keep every unit input of its graph
    values = _fill(values, slots, [None] * len(slots))

    def run(*ts: torch.Tensor) -> Any:
        filled = _fill(values, slots, ts)
        return forward(*filled[:n_args], **dict(zip(names, filled[n_args:], strict=True)))

    box: list[Any] = []
    outs = _Recompute.apply(run, box, len(tensors), *tensors, *anchor)
    out, out_slots = box[0]
    return _fill([out], out_slots, outs)[0]


def _tensors(values: list[Any]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """The tensors in `values` (each a tensor or a tuple/list holding some) and where each is: (value, item or -1)."""
    tensors, slots = [], []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            slots.append((i, -1))
        elif isinstance(v, (tuple, list)):
            for j, item in enumerate(v):
                if isinstance(item, torch.Tensor):
                    tensors.append(item)
                    slots.append((i, j))
    return tensors, slots


def _fill(values: list[Any], slots: list[tuple[int, int]], tensors: Any) -> list[Any]:
    """`values` with the tensors at `slots` replaced by `tensors` (tuples rebuilt as their own type)."""
    filled = list(values)
    inner: dict[int, list[Any]] = {}
    for (i, j), t in zip(slots, tensors, strict=True):
        if j < 0:
            filled[i] = t
        else:
            inner.setdefault(i, list(values[i]))[j] = t
    for i, items in inner.items():
        kind = type(values[i])
        filled[i] = kind(*items) if hasattr(kind, "_fields") else kind(items)  # a namedtuple takes positions
    return filled


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], box: list[Any], n: int, *tensors: torch.Tensor) -> Any:
        ctx.run, ctx.n, ctx.num_inputs = run, n, len(tensors)
        ctx.set_materialize_grads(False)  # an output nothing reads gets None, not a zero-filled gradient
        ctx.save_for_backward(*tensors[:n])
        out = run(*tensors[:n])  # autograd is off in a Function's forward
        outs, slots = _tensors([out])
        box.append((out, slots))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        need = ctx.needs_input_grad[3:3 + ctx.n]
        inputs = [t.detach().requires_grad_() if r else t for t, r in zip(ctx.saved_tensors, need, strict=True)]
        run, ctx.run = ctx.run, None  # one backward (no retain_graph under checkpointing)
        with torch.enable_grad():
            outs = _tensors([run(*inputs)])[0]
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del outs, pairs  # the recomputed graph's activations go now, not when the engine drops this node
        return (None, None, None, *(x.grad if r else None for x, r in zip(inputs, need, strict=True)),
                *([None] * (ctx.num_inputs - ctx.n)))
