"""The root's per-iteration state: where one forward + backward of the sharded model is, and its two boundaries.

  begin (root pre-forward)  every iteration starts here. If the previous backward never reached its end (it raised,
                            e.g. an OOM the caller caught), its state is torn down first: pending reductions are
                            waited for and dropped, every unit is resharded, the hooks' bookkeeping cleared. The
                            step's gradients are lost: the caller zeroes them and redoes the step.
  end   (autograd callback) queued by the first backward hook, runs once the whole backward is done: reduces zeros
                            for flats whose gradient never arrived, issues the adapters' all-reduce, retires every
                            pending reduction and reshards everything.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shardtune.engine.unit import EngineContext


@dataclass
class StepState:
    requires_grad_sync: bool = True  # set by the trainer per micro-step: reduce on this backward, or keep local
    requires_all_reduce: bool = True  # replicated params reduce on a synced backward only if this is set too
    in_backward: bool = False  # between the first backward hook and the end-of-backward callback
    num_aborted: int = 0  # backwards that raised and were cleaned up at the next begin (tests)


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
