"""A unit: the module whose parameters are all-gathered and reduce-scattered together, and its hooks.

State machine per unit:  SHARDED --unshard()--> GATHERING --wait()--> UNSHARDED --reshard()--> SHARDED.

One training step of full_shard (units 0..L-1 in forward order, the root unit holds embeddings/norm/head):
  forward : root pre-hook starts the iteration (begin_iteration) and gathers the root, prefetching unit 0; unit
            i's pre-hook waits for its gather and prefetches unit i+1; its post-hook frees it, except the last unit
            (backward needs it first: saves one all-gather) and under shard_grad_op (all stay gathered until their
            backward). The root stays gathered.
  backward: a hook on unit i's outputs (fires when their gradient is ready, just before the unit's backward)
            re-gathers unit i and prefetches unit i-1; hooks on the parameter views free the gathered buffer once
            every parameter's gradient exists (before autograd cats them into the flat gradient); when the flat
            gradient reaches the leaf, the post-accumulate-grad hook hands it to the reducer (reduce.py), which
            reduce-scatters it asynchronously into this rank's shard.
  end     : an autograd-engine callback (_end_backward) reduces any flat whose gradient never arrived (zeros; keeps
            collectives matched across ranks), waits for the reductions and reshards everything.
Under no_grad (eval, generate) every unit, root included, is freed after its forward.
Frozen weights (LoRA base) get no gradient hooks: a unit with frozen flats is freed when the gradient of its inputs
is computed (an identity autograd Function on its inputs), i.e. as soon as its backward is over.
Replicated params (LoRA adapters) are reduced in the end-of-backward callback, one bucket (replicated.py).
Activation checkpointing, ours (checkpointing.py) or HF's (transformers >= 5 checkpoints `forward`, not `__call__`),
runs the recompute inside the unit's backward without its module hooks, on the buffer its backward gathered: no
forward hook ever runs during backward.
Limits: a unit's forward runs once per iteration (a module reused within one forward would rebind its views);
the trainer calls the root module (its pre-hook starts the iteration).
"""
from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from shardtune import accelerator
from shardtune.engine.api import BackwardSchedule, ShardingStrategy
from shardtune.engine.collectives import CommCounter, all_gather_into
from shardtune.engine.flat_param import FlatParam
from shardtune.engine.reduce import GradReducer
from shardtune.engine.replicated import ReplicatedParams


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # async all-gather in flight
    UNSHARDED = "unsharded"


# The root's per-iteration state: where one forward + backward of the sharded model is, and its two boundaries.
#   begin (root pre-forward)  every iteration starts here. If the previous backward never reached its end (it raised,
#                             e.g. an OOM the caller caught), its state is torn down first: pending reductions are
#                             waited for and dropped, every unit is resharded, the hooks' bookkeeping cleared. The
#                             step's gradients are lost: the caller zeroes them and redoes the step.
#   end   (autograd callback) queued by the first backward hook, runs once the whole backward is done: reduces zeros
#                             for flats whose gradient never arrived, issues the adapters' all-reduce, retires every
#                             pending reduction and reshards everything.
# They live with the units: the context holds the units, the units' hooks call them (one concern, one file).
@dataclass
class StepState:
    requires_grad_sync: bool = True  # set by the trainer per micro-step: reduce on this backward, or keep local
    requires_all_reduce: bool = True  # replicated params reduce on a synced backward only if this is set too
    in_backward: bool = False  # between the first backward hook and the end-of-backward callback
    num_aborted: int = 0  # backwards that raised and were cleaned up at the next begin (tests)


@dataclass
class EngineContext:
    """State shared by all units of one sharded model."""

    strategy: ShardingStrategy
    shard_group: ProcessGroup | None  # None: a group of one rank (no_shard)
    replicate_group: ProcessGroup | None  # hybrid_shard / no_shard: grads all-reduced across it
    reduce_dtype: torch.dtype
    prefetch: bool
    backward_schedule: BackwardSchedule = BackwardSchedule.STAGGERED
    counter: CommCounter = field(default_factory=CommCounter)
    units: list[Unit] = field(default_factory=list)  # non-root units, forward order
    root: Unit | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # compute device
    replicated: ReplicatedParams | None = None  # LoRA adapters: whole on every rank, one reduction per step
    reducer: GradReducer | None = None  # the units' gradient reductions in flight (reduce.py)
    step: StepState = field(default_factory=StepState)  # per-iteration root state (begin_iteration)
    # CPU offload on an accelerator: the H2D copies of the shards, their casts and the all-gathers that read them
    # are issued on this stream (FSDP2's copy-in stream), so the compute stream never queues behind a PCIe copy.
    copy_stream: Any = None
    # vocab_parallel under hybrid_shard: the trainable tables' row gradients, summed over the replicas (vocab.py)
    vocab_replicas: ReplicatedParams | None = None


class Unit:
    def __init__(self, module: nn.Module, flats: list[FlatParam], ctx: EngineContext, *,
                 index: int, is_root: bool) -> None:
        self.module = module
        self.flats = flats  # [trainable?, frozen?]
        self.ctx = ctx
        self.index = index  # position in ctx.units (-1 for the root)
        self.is_root = is_root
        self.state = ShardState.SHARDED
        self.num_unshards = 0  # gathers issued (forward, backward; never by a checkpoint recompute): tests, bench
        self._works: list[Any] = []
        self._sends: list[torch.Tensor] = []  # bf16 casts of the shards, alive until the gather completes
        self._copied = None  # offload: event on the copy stream after this gather's copies (what compute waits on)
        self._leaves: dict[int, torch.Tensor] = {}  # flat index -> autograd leaf of this forward
        self._pending_post_backward: set[int] = set()  # flats whose gradient has not been reduced yet
        self._pre_backward_done = False
        self._inputs_grad_done = False  # the gradient of the unit's inputs has been computed (backward over)
        self._param_grads_left = 0  # parameter views whose gradient autograd has not produced yet
        self._grad_numel_left = 0  # their elements: the deferred prefetch goes out once half are done
        self._grad_numel = 0  # all of the unit's parameter-view elements (the "half" above)
        self._deferred_prefetch: Unit | None = None  # the previous unit, gathered mid-backward (see _pre_backward)
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # -- unshard / reshard ---------------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool) -> None:
        if self.state is not ShardState.SHARDED:
            return
        self.num_unshards += 1
        ctx = self.ctx
        stream = ctx.copy_stream
        if stream is not None:
            # `full` is allocated on the compute stream below; the copy stream may write it only once the compute
            # work queued before that allocation (the previous user of its memory) is done.
            stream.wait_stream(accelerator.current_stream(ctx.device))
        for flat in self.flats:
            if not (flat.aliased or flat.local):
                flat.alloc_full()
        staged = [flat for flat in self.flats if flat.local and flat.stage_rows()]  # offload: tables' rows, ahead
        with accelerator.use_stream(stream):
            for flat in staged:
                flat.copy_rows()
            for flat in self.flats:
                if flat.aliased or flat.local:  # local: a row-sharded vocabulary table, never gathered
                    continue
                send = flat.gather_input()
                if ctx.shard_group is None:
                    flat.full.copy_(send)
                    continue
                self._sends.append(send)
                self._works.append(all_gather_into(flat.full, send, ctx.shard_group, ctx.counter,
                                                   async_op=async_op, label=flat.label))
            if stream is not None:
                self._copied = accelerator.new_event(ctx.device)
                self._copied.record(stream)
        self.state = ShardState.GATHERING

    def wait(self) -> None:
        self.unshard(async_op=False)
        if self._copied is not None:
            # The compute that reads the gathered buffer waits for this gather's copies (one event), not for
            # everything the copy stream holds (the next unit's prefetch may be queued there already).
            accelerator.current_stream(self.ctx.device).wait_event(self._copied)
            self._copied = None
        for w in self._works:
            if w is not None:
                w.wait()
        self._works.clear()
        self._sends.clear()
        self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        if self.state is ShardState.GATHERING:
            self.wait()  # never free a buffer a collective is still writing
        for flat in self.flats:
            flat.free_full()
            if flat.local:
                flat.unstage_rows()
        self.state = ShardState.SHARDED

    def _keep_after_forward(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self.is_root or self.ctx.strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            return True
        return self.index == len(self.ctx.units) - 1  # the last unit is the first one backward needs

    # -- forward hooks ---------------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> Any:
        ctx = self.ctx
        if self.is_root:
            begin_iteration(ctx)
        self.wait()
        grad = torch.is_grad_enabled()
        self._leaves.clear()
        # Free early only when every parameter is trainable: a frozen weight may still be needed (LoRA base).
        early_free = grad and all(f.requires_grad for f in self.flats if not f.local)
        self._param_grads_left = 0
        self._grad_numel_left = 0
        for i, flat in enumerate(self.flats):
            if flat.local:
                continue
            src, views = flat.bind_views(requires_grad=grad and flat.requires_grad)
            if grad and flat.requires_grad:
                self._leaves[i] = src
                src.register_post_accumulate_grad_hook(_weak_hook(self, Unit._post_backward, i))
                self._pending_post_backward.add(i)
                if early_free:
                    self._param_grads_left += len(views)
                    self._grad_numel_left += sum(v.numel() for v in views)
                    for v in views:
                        v.register_hook(_weak_hook(self, Unit._on_param_grad))
        self._grad_numel = self._grad_numel_left
        self._pre_backward_done = False
        self._inputs_grad_done = False
        nxt = ctx.units[self.index + 1] if self.index + 1 < len(ctx.units) else None
        if ctx.prefetch and nxt is not None:
            nxt.unshard(async_op=True)  # overlaps the next unit's all-gather with this unit's compute
        if grad and not early_free and not self.is_root:
            # Frozen weights (LoRA base) get no gradient, so no gradient hook says when the unit's backward is over;
            # the gradient of its inputs does: free the unit then, not at the end of the whole backward.
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            if tensors:
                outs = _InputsGradHook.apply(_weak_hook(self, Unit._on_inputs_grad), *(args[i] for i in tensors))
                args = list(args)
                for i, t in zip(tensors, outs, strict=True):
                    args[i] = t
                return tuple(args)
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(_weak_hook(self, Unit._pre_backward))
        if not self._keep_after_forward():
            self.reshard()
        return output

    def reset(self) -> None:
        """Iteration boundary (begin_iteration, _end_backward): resharded, no gradient expected any more."""
        if self.state is not ShardState.SHARDED:
            self.reshard()
        self._pending_post_backward.clear()
        self._leaves.clear()
        self._deferred_prefetch = None

    # -- backward hooks --------------------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        start_backward(ctx)
        if self._pre_backward_done:
            return
        self._pre_backward_done = True
        self.wait()
        prev = ctx.units[self.index - 1] if self.index >= 1 else None
        # Staggered memory schedule of the backward (trainable units; frozen LoRA bases reduce nothing): at most
        # one unit beyond the current one is alive, either the next unit's gradient whose reduction is in flight or
        # the previous unit gathered ahead. Overlap holds both: one unit more, more communication hidden.
        if ctx.backward_schedule is BackwardSchedule.OVERLAP:
            # FSDP2's: the previous unit's gather goes out now, under this unit's whole backward; the oldest
            # reduction is waited for at the next post-backward (reduce.py make_room), none in between.
            if prev is not None and ctx.prefetch:
                prev.unshard(async_op=True)
            return
        if prev is None:
            if self._param_grads_left:
                # The first unit runs last, on top of every later unit's sharded gradient (the deepest point of
                # the backward): nothing to gather ahead, and the reductions in flight are retired before it starts.
                ctx.reducer.drain()
            return
        if not ctx.prefetch:
            return
        if self._param_grads_left and ctx.reducer.num_in_flight:
            # Staggered: the reduction overlaps the first half of this unit's backward (by gradient elements: a
            # decoder block's MLP), is retired, then the gather overlaps the second half (_on_param_grad). On one
            # link the two would share the bandwidth anyway; the bytes moved are the same.
            self._deferred_prefetch = prev
            return
        prev.unshard(async_op=True)

    def _on_param_grad(self, grad: torch.Tensor) -> None:
        """Gradient of one parameter view computed. Half-way through the unit's gradient elements, the deferred
        prefetch goes out (after retiring the reduction in flight). After the last one the unit's backward needs no
        parameter any more: free the gathered buffer before autograd cats the flat gradient (peak -1 unit), and
        retire the reduction in flight (peak unchanged by async reduction)."""
        self._param_grads_left -= 1
        self._grad_numel_left -= grad.numel()
        prev = self._deferred_prefetch
        if prev is not None and (2 * self._grad_numel_left <= self._grad_numel or not self._param_grads_left):
            self._deferred_prefetch = None
            self.ctx.reducer.make_room()
            prev.unshard(async_op=True)
        if self._param_grads_left == 0:
            self.reshard()
            if self.ctx.backward_schedule is BackwardSchedule.STAGGERED:
                # The flat gradient's cat comes next: retire the previous unit's reduction first (it overlapped
                # this unit's whole backward), so the cat never holds it too: the backward peak does not grow.
                self.ctx.reducer.make_room()

    def _on_inputs_grad(self, _: Any) -> None:
        """Every path from the unit's outputs to its inputs has run: no frozen weight is needed any more."""
        self._inputs_grad_done = True
        if not self._pending_post_backward:
            self.reshard()

    def _post_backward(self, i: int, leaf: torch.Tensor) -> None:
        grad = leaf.grad  # 1D, compute dtype, numel P: the unit's flat gradient for this micro-batch
        leaf.grad = None  # the reducer holds the only reference: freed once reduced
        self._pending_post_backward.discard(i)
        if not self._pending_post_backward and (self._inputs_grad_done
                                                or all(f.requires_grad for f in self.flats if not f.local)):
            # Free the gathered parameters before reducing: lowers the backward peak by one unit (the root's
            # embeddings + head for the last one).
            self.reshard()
        self.ctx.reducer.reduce(self.flats[i], grad, sync=self.ctx.step.requires_grad_sync)
        if self.index == 0 and self._grad_numel and self.ctx.backward_schedule is BackwardSchedule.STAGGERED:
            # The first unit's reduction would overlap the root's embedding backward, whose gradient is the largest
            # of the step: retired now instead (same reason as in _pre_backward).
            self.ctx.reducer.drain()

    def reduce_missing_grads(self) -> None:
        """End of backward: no gradient reached these flats (unused parameters): reduce zeros so every rank runs the
        same collectives in the same order."""
        for i in sorted(self._pending_post_backward):
            self.ctx.reducer.reduce(self.flats[i], torch.zeros_like(self._leaves[i]),
                                    sync=self.ctx.step.requires_grad_sync)
        self._pending_post_backward.clear()


def begin_iteration(ctx: EngineContext) -> None:
    """Root pre-forward. Also drops what a forward without backward (eval with grad on) left behind."""
    if ctx.step.in_backward:
        ctx.reducer.abandon()
        for r in (ctx.replicated, ctx.vocab_replicas):
            if r is not None:
                r.abandon()
        ctx.step.in_backward = False
        ctx.step.num_aborted += 1
    else:
        # The previous backward's offloaded gradients: add them on the host now (syncs on their D2H events) so
        # host buffers do not pile up over micro-steps.
        ctx.reducer.wait()
    for u in [*ctx.units, ctx.root]:
        u.reset()


def start_backward(ctx: EngineContext) -> None:
    """First backward hook of the iteration: arrange for `end_backward` once autograd is done."""
    if not ctx.step.in_backward:
        ctx.step.in_backward = True
        # Runs once the whole backward pass is done (CPU: on this thread; CUDA: after queued kernels). Not run when
        # the backward raises: `begin_iteration` cleans up then.
        torch.autograd.Variable._execution_engine.queue_callback(_end_backward(ctx))


def _end_backward(ctx: EngineContext) -> Callable[[], None]:
    def run() -> None:
        for u in [*ctx.units, ctx.root]:
            u.reduce_missing_grads()  # zeros: every rank runs the same collectives in the same order
        sync = ctx.step.requires_grad_sync
        once = sync and ctx.step.requires_all_reduce  # the trainer: a step's last micro-step
        replicas = [r for r in (ctx.replicated, ctx.vocab_replicas) if r is not None] if once else []
        if ctx.vocab_replicas in replicas:  # offload: the tables' D2H copies summed into the bucket first (host waits)
            ctx.reducer.add_host_copies(lambda flat: flat.local)
        for r in replicas:
            r.start_reduce()  # adapters (and hybrid vocab tables): one bucketed all-reduce, after the reductions
        ctx.reducer.finish_backward()
        for r in replicas:
            r.finish_reduce()
        for u in [*ctx.units, ctx.root]:
            u.reset()
        ctx.step.in_backward = False
    return run


class _InputsGradHook(torch.autograd.Function):
    """Identity on a unit's inputs. Its backward runs once the gradients of all of them are ready, i.e. after every
    node of the unit's backward that leads to them (those are the ones that read the unit's weights)."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[Any], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook(None)
        return (None, *grads)


def _weak_hook(unit: Unit, method: Callable[..., Any], *args: Any) -> Callable[[torch.Tensor], Any]:
    """A tensor hook calling `method(unit, *args, tensor)` through a weak reference. Autograd keeps tensor hooks on
    its C++ side, where Python's garbage collector cannot see cycles: a hook holding the unit strongly would keep
    module -> parameter views -> autograd graph -> hook -> unit -> module alive forever."""
    ref = weakref.ref(unit)

    def hook(t: torch.Tensor) -> Any:
        u = ref()
        return None if u is None else method(u, *args, t)
    return hook


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors in a module output: tensors, tuples/lists, dicts and HF ModelOutputs (dict subclasses)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
