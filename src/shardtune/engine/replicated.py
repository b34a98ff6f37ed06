"""Replicated trainable parameters (LoRA adapters): whole on every rank, outside the flat buffers.

They are small next to the base (0.4 GiB of fp32 adapters on a 70B QLoRA), so their VALUES stay whole on every
rank: sharding them would cost a collective per unit. Their gradient must be summed over all ranks (our gradient
contract: SUM, see api.py), once per optimizer step, in one collective over one flat bucket issued at the end of
the step's last backward (async: it overlaps the wait for the units' last reductions, engine/unit.py _end_backward).

Accumulation across micro-steps: a hook on each parameter takes the new local gradient before autograd
accumulates it, adds it into `pending` (1D, fp32, every adapter) and hands autograd nothing to add: zeros where the
parameter has a `.grad`, else the gradient itself, which autograd takes as `.grad` without a kernel and a second
hook, after accumulation, drops again (kept, 0.39 GiB on a 70B QLoRA alive through every backward; zeros there would
cost a fill and autograd's dense copy of them, two kernels per adapter per micro-batch). Every rank then computes the
same sums in the same order: the replicas stay bit-identical (a "p.grad - local + sum" scheme would not: float
rounding differs per rank and the copies drift).

`shard_states=True` (engine.shard_adapter_states, ZeRO-2 for the adapters): each rank OWNS a contiguous run of the
adapters (balanced by numel; rank r's laid out at r·M in `pending`, M = the largest rank's numel) and alone holds
their gradient and AdamW state. The sum over ranks is a reduce-scatter of `pending` (each rank receives its own
run), the optimizer steps the owned adapters only, and a post-step hook all-gathers the stepped values into every
rank's copies (a global optimizer hook: any optimizer holding an owned adapter triggers it, so every rank must step
together, as the trainer does; a rank that steps alone would wait in the all-gather). Same bytes on the wire as the all-reduce (reduce-scatter + all-gather = one all-reduce); memory per
rank: gradients and AdamW state 12·N/W bytes instead of 12·N.

Host-resident parameters (the vocabulary tables of a hybrid run under cpu_offload): their gradients arrive on the
host, so `pending` sums there, in one pinned bucket kept for the run (zeroed when a step's first gradient lands).
The collective runs on a copy on `device` (the group's: NCCL takes no host tensor), made without blocking from the
pinned bucket; each parameter's reduced slice goes back through `land` (engine/shard.py: the units' reducer, a
non-blocking D2H on the copy stream into the table's landing buffer, added into p.grad when the optimizer next
reads gradients). The host never waits here. Cost: one H2D and one D2H of the bucket per step, and the bucket on
the device from the all-reduce until its D2H has read it.

Cost: one bucket of adapter size (fp32) during every backward of a step; per step 4(W-1)/W x adapter bytes of
traffic (reduce-scatter + all-gather, or the all-reduce).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardtune import accelerator
from shardtune.engine.collectives import CommCounter, all_gather_into, all_reduce_, reduce_scatter_into


def partition(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each parameter: contiguous runs in order, balanced by numel (a parameter goes to the rank whose
    equal share holds its middle element). Non-decreasing; the plan uses it too."""
    total = max(1, sum(sizes))
    owners, start = [], 0
    for n in sizes:
        owners.append(min(world - 1, (2 * start + n) * world // (2 * total)))
        start += n
    return owners


def run_sizes(sizes: list[int], owners: list[int], world: int) -> list[int]:
    """Numel of each rank's run under `owners` (the plan sizes the bucket and the states with it too)."""
    per_rank = [0] * world
    for n, o in zip(sizes, owners, strict=True):
        per_rank[o] += n
    return per_rank


class ReplicatedParams:
    def __init__(self, params: list[tuple[str, nn.Parameter]], group: ProcessGroup | None,
                 counter: CommCounter, *, device: torch.device, shard_states: bool = False,
                 label: str = "adapters", land: Callable[[nn.Parameter, torch.Tensor], None] | None = None) -> None:
        self.params = params  # (name, parameter) in named_parameters() order
        self.group = group  # None: one rank, nothing to reduce
        self.counter = counter
        self.device = device  # where the group's collectives run (the compute device)
        self.label = label  # the collectives' name on the simulated GPU's record
        # Given for host-resident params only (offloaded vocabulary tables; their residence is the flat's flag, as on
        # the simulated GPU both sides are meta): how a reduced gradient, a slice of the device bucket, reaches p.grad
        self.land = land
        self._host_bucket: torch.Tensor | None = None  # host-resident params: the pinned `pending`, kept for the run
        world = 1 if group is None else dist.get_world_size(group)
        self.sharded = shard_states and world > 1 and bool(params)
        self.rank = dist.get_rank(group) if self.sharded else 0
        self.pending: torch.Tensor | None = None  # 1D, fp32, numel = bucket_numel: local grads not reduced yet
        self._reduced: torch.Tensor | None = None  # sharded: 1D, fp32, numel = chunk: this rank's reduced sums
        self._work = None  # the collective over `pending`, between start_reduce and finish_reduce
        sizes = [p.numel() for _, p in params]
        owners = partition(sizes, world) if self.sharded else [0] * len(params)
        self.owned = [o == self.rank for o in owners]
        per_rank = run_sizes(sizes, owners, world)
        self.owned_numel = per_rank[self.rank]
        self.chunk = max(per_rank)  # M: each rank's run, padded to the largest
        self.bucket_numel = world * self.chunk if self.sharded else per_rank[0]
        self._offsets: list[int] = []  # where each parameter sits in `pending`
        filled = [0] * world
        for (_, p), o in zip(params, owners, strict=True):
            self._offsets.append(o * self.chunk + filled[o] if self.sharded else filled[0])
            filled[o] += p.numel()
        self._fresh = [False] * len(params)  # p.grad was None when autograd got our zeros: drop what it made
        ref = weakref.ref(self)  # weak: autograd and the optimizer keep hooks out of the gc's sight
        if group is not None and params:
            for i, (_, p) in enumerate(params):
                p.register_hook(lambda g, i=i: _call(ref, "_add", i, g))
                p.register_post_accumulate_grad_hook(lambda _p, i=i: _call(ref, "_drop_zeros", i))
        # Sharded, fewer adapters than ranks: a rank may own none. It still steps an empty run (a 0-element
        # parameter in its optimizer, a 0-element gradient each step), so its optimizer step triggers the post-step
        # all-gather every other rank enters, and its AdamW step counter (what a checkpoint saves) counts like theirs.
        self._empty_run: nn.Parameter | None = None
        if self.sharded and not any(self.owned):
            self._empty_run = nn.Parameter(torch.zeros(0, device=params[0][1].device))
        if self.sharded:
            self._owned_ids = {id(p) for p in self.owned_params()}
            hook = register_optimizer_step_post_hook(
                lambda opt, args, kwargs: _call(ref, "_after_step", opt))
            weakref.finalize(self, hook.remove)

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A local gradient of `param` that reached the host outside autograd (an offloaded vocabulary table's
        landed D2H copy, engine/vocab.py): summed into the bucket as the hook would."""
        (i,) = [k for k, (_, p) in enumerate(self.params) if p is param]
        self._add(i, grad.view_as(param))
        self._fresh[i] = False  # autograd never accumulates into it: nothing to drop

    def _add(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:  # an offloaded table's use: its gradient comes later, through `add`
            return None
        if self.pending is None:
            self.pending = self._new_pending(grad.device)
        a = self._offsets[i]
        self.pending[a:a + grad.numel()].add_(grad.reshape(-1))
        self._fresh[i] = self.params[i][1].grad is None
        # What autograd accumulates instead: nothing. With no .grad yet, the gradient itself, which autograd takes
        # as .grad with no kernel and `_drop_zeros` drops (zeros here would cost two: the fill and autograd's dense
        # copy of them); else zeros, added into the .grad there is.
        return grad if self._fresh[i] else grad.new_zeros(()).expand_as(grad)

    def _drop_zeros(self, i: int) -> None:
        if self._fresh[i]:
            self.params[i][1].grad = None  # what autograd took of ours: p.grad stays "nothing reduced"
            self._fresh[i] = False

    def start_reduce(self) -> None:
        """End of the step's last backward: sum the pending local gradients over ranks (one async collective)."""
        if self.group is None or not self.params:
            return
        if self.pending is None:  # no adapter gradient on this rank: still join the collective
            self.pending = self._new_pending(self.params[0][1].device)
        if self.sharded:
            self._reduced = torch.empty(self.chunk, dtype=torch.float32, device=self.pending.device)
            # pending is scratch (dropped after): gloo then reduces in place, without its own copy of the input
            self._work = reduce_scatter_into(self._reduced, self.pending, self.group, self.counter,
                                             full_is_scratch=True, async_op=True, label=self.label)
        else:
            assert self.pending.device == self.device or not self.sharded, "sharded adapters live on the device"
            if self.land is not None:  # host-resident params: reduce a device copy of the pinned sums
                self.pending, _ = accelerator.copy_to_device(self.pending, self.device, label=self.label)
            self._work = all_reduce_(self.pending, self.group, self.counter, async_op=True, label=self.label)

    def finish_reduce(self) -> None:
        """Wait for `start_reduce`'s collective (it overlapped the units' last reductions), add it to p.grad."""
        if self.group is None or not self.params:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        source, base = (self._reduced, self.rank * self.chunk) if self.sharded else (self.pending, 0)
        if self.land is not None:  # host-resident params: each slice D2H, added later
            assert not self.sharded, "host-resident params are replicas"
            for (_, p), a in zip(self.params, self._offsets, strict=True):
                self.land(p, source[a:a + p.numel()])
            self.pending = None
            return
        if self._empty_run is not None:
            self._empty_run.grad = torch.zeros_like(self._empty_run)
        fresh, added = [], []  # (param, its reduced slice): a first gradient / one added to an existing one
        for (_, p), a, mine in zip(self.params, self._offsets, self.owned, strict=True):
            if mine:  # another rank's: its gradient (and AdamW state) lives there only
                (fresh if p.grad is None else added).append((p, source[a - base:a - base + p.numel()].view_as(p)))
        # Multi-tensor calls: a few kernels on a GPU, not one per adapter
        if added:
            torch._foreach_add_([p.grad for p, _ in added], [r for _, r in added])
        if self.sharded:  # the reduced run is this rank's own buffer: the gradients are views of it
            for p, reduced in fresh:
                p.grad = reduced
        elif fresh:  # copies: the bucket is freed now
            grads = [torch.empty_like(p) for p, _ in fresh]
            torch._foreach_copy_(grads, [r for _, r in fresh])
            for (p, _), g in zip(fresh, grads, strict=True):
                p.grad = g
        self.pending = self._reduced = None

    def _new_pending(self, device: torch.device) -> torch.Tensor:
        """A zeroed bucket for a step's local sums: on the device, or for host-resident params the pinned host
        bucket (made once: pinning per step would cost a page-locking call each time). Its last H2D has run: the
        optimizer read the reduced gradients after their D2H, which follows it on the device."""
        if self.land is None:
            return torch.zeros(self.bucket_numel, dtype=torch.float32, device=device)
        if self._host_bucket is None:
            self._host_bucket = accelerator.host_resident(self.bucket_numel, torch.float32, self.device)
        return self._host_bucket.zero_()

    def abandon(self) -> None:
        """A backward raised: wait for a collective in flight (its buckets must outlive it), drop the local sums."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.pending = self._reduced = None
        self._fresh = [False] * len(self.params)

    def owned_named_params(self) -> list[tuple[str, nn.Parameter]]:
        """What this rank's optimizer steps: every adapter, or (sharded) this rank's run (maybe the empty one)."""
        if self._empty_run is not None:
            return [("empty_run", self._empty_run)]
        return [(n, p) for (n, p), mine in zip(self.params, self.owned, strict=True) if mine]

    def owned_params(self) -> list[nn.Parameter]:
        return [p for _, p in self.owned_named_params()]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.owned_params() if p.grad is not None]

    def sq_norm_group(self) -> ProcessGroup | None:
        """Where the squared norm of `grads()` must be summed: over the owners (sharded), nowhere (replicas)."""
        return self.group if self.sharded else None

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if any(id(p) in self._owned_ids for g in optimizer.param_groups for p in g["params"]):
            self.gather_params()

    def gather_params(self) -> None:
        """Sharded: every rank's stepped run, all-gathered into every rank's copies (one collective)."""
        owned = [p for (_, p), m in zip(self.params, self.owned, strict=True) if m]
        device = self.params[0][1].device
        mine = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        if owned:
            torch.cat([p.detach().reshape(-1) for p in owned], out=mine[:self.owned_numel])
        full = torch.empty(self.bucket_numel, dtype=torch.float32, device=device)
        all_gather_into(full, mine, self.group, self.counter, label=self.label)
        others = [(p, full[a:a + p.numel()].view_as(p))
                  for (_, p), a, m in zip(self.params, self._offsets, self.owned, strict=True) if not m]
        if others:
            with torch.no_grad():  # one multi-tensor copy, not one per adapter
                torch._foreach_copy_([p for p, _ in others], [v for _, v in others])

    def state_bytes(self) -> int:
        return sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for _, p in self.params)


def _call(ref: weakref.ref[ReplicatedParams], method: str, *args: Any) -> Any:
    owner = ref()
    return None if owner is None else getattr(owner, method)(*args)
