"""`shardtune plan RECIPE --simulate`: one real training step of the recipe, at its real size and world size, on
the simulated GPU (accelerator.py: meta tensors, a fake process group), with the memory tracker counting live meta
bytes. What it checks: the analytic plan (estimate.py) against the engine's real allocations, op by op.

How, and what it leaves out:
  - Rank 0 alone stands in for the world: the fake group's collectives complete at once and return tensors of the
    right shapes, so rank 0 allocates exactly what it would beside N-1 peers. Everything is the real code path:
    build_model, parallelize (LoRA, checkpointing, sharding, NF4), the optimizer, `train.train_step`.
  - Rank 0 builds the data alone (data/ranks.py's agreement needs real peers on a gloo group).
  - The seeded init is skipped (parallelize's `init_into_shards`): it draws every module on the host, minutes at
    70B, and a meta shard holds no values anyway.
  - AdamW's moments are created before the step (as a resume does): the plan's peak is a later step's, with them.
  - A DPO recipe with an SFT warm-up runs its first DPO step (`first_full_step`), the one the plan predicts; a GRPO
    recipe its step 1 (step 0 also samples the held-out "before" eval), generation included.
  - The step runs min(grad_accum, 2) micro-steps: the plan's peak depends on grad_accum only through "earlier
    micro-steps' gradients exist" (> 1), which the second micro-step already has.
  - Offloaded host buffers (`accelerator.host_empty`, `host_resident`) are simulated host tensors (simulated/host.py
    `HostMeta`): a CPU tensor of 100 GB cannot be allocated here. Ops on them stay host (counted apart, as host
    bytes); their non-blocking `.to()` (the engine's H2D copy) makes a new device tensor, as the copy on a GPU does.
    FSDP2's offloaded shards and gradients are simulated host tensors too (simulated/fsdp2_offload.py).
  - SDPA takes the kernel CUDA would (`_cuda_sdpa`: flash without a mask; with the packing mask the memory-efficient
    kernel and its per-layer bias), not the math path torch picks on meta.
  - Values are not computed (meta): the loss and norms read as 0. Packed rows' position ids read as zeros.

What a GPU would wait on (simulated/launches.py, plan/roofline.py): the counted step's kernel launches by phase,
FLOPs and bytes, scaled from its min(grad_accum, 2) micro-steps to the recipe's grad_accum; the host CPU seconds of
a second step run bare (no tracker, no counter: the steady state, as the host would run it less the launches'
driver time), scaled the same way in proportion to launches, and on this machine; the roofline's GPU time on the
recipe's hardware.gpu, and the verdict: host-bound or GPU-bound.
"""
from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardtune import accelerator, memory
from shardtune.plan import roofline
from shardtune.plan.grpo import ROLLOUT_PHASES
from shardtune.plan.hardware import CUDA_CONTEXT, load_profile
from shardtune.simulated import device as simulated_device
from shardtune.simulated.host import host_empty as _host_empty
from shardtune.simulated.host import is_host as _is_host
from shardtune.simulated.process_group import standing_in_for_world


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """SDPA as CUDA dispatches it. No mask: the flash kernel, which saves q, k, v (grouped heads not repeated), the
    output and the log-sum-exp.
    A mask (packed rows): flash takes none, so the memory-efficient kernel runs, on a bias in the query's dtype
    that SDPA makes from a boolean mask in every call and that backward keeps: b·s² per layer. On meta, torch would
    pick the math path, which saves the b·heads·s² attention weights of every layer (64 GiB at 8B, 4k tokens)."""
    if attn_mask is None:  # CUDA's flash kernel reads grouped k/v heads as they are: nothing repeated, nor saved
        out, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale)
        return out
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)
    return out


@dataclass
class Simulation:
    world: int
    device_peak: int  # bytes, rank 0, one step
    host_peak: int  # bytes of this rank's host buffers (offload), at the same step
    analytic: int  # the plan's per-rank peak
    analytic_host: int  # the plan's host bytes per rank
    wall_s: float
    micro_steps: int
    # What CUDA's allocators would hold (simulated/allocator.py): the caching allocator's peaks (blocks rounded,
    # segments, record_stream), and the pinned host pool's (power-of-two blocks unless configured otherwise).
    allocated_peak: int = 0
    reserved_peak: int = 0
    pinned_reserved_peak: int = 0
    alloc_retries: int = 0  # times the caching allocator freed its cached segments to make room (device full)
    ooms: int = 0  # requests that did not fit even then: out of memory on the GPU
    # GRPO: the peak of the step's rollout (sampling and log-probs, the objective's before_step, before the first
    # micro-step) beside the plan's phases for it (plan/grpo.py generate, logps); 0 for other objectives
    rollout_peak: int = 0
    analytic_rollout: int = 0
    host_syncs: list[str] = field(default_factory=list)  # "kind caller" of each host synchronization of the step
    # Per optimizer step (the recipe's grad_accum): simulated/launches.py's `per_step` figures
    launches: dict[str, Any] = field(default_factory=dict)
    host_cpu_s: float = 0.0  # process CPU seconds of one step, on this machine (`machine`)
    machine: str = ""
    speed: roofline.StepTime | None = None

    @property
    def ratio(self) -> float:
        return self.device_peak / self.analytic if self.analytic else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world, "simulated_peak_bytes": self.device_peak,
                "simulated_host_bytes": self.host_peak, "analytic_peak_bytes": self.analytic,
                "analytic_host_bytes": self.analytic_host, "ratio": round(self.ratio, 4),
                "wall_s": round(self.wall_s, 2), "micro_steps": self.micro_steps,
                "allocator_allocated_peak_bytes": self.allocated_peak,
                "allocator_reserved_peak_bytes": self.reserved_peak,
                "pinned_reserved_peak_bytes": self.pinned_reserved_peak, "allocator_alloc_retries": self.alloc_retries,
                "allocator_ooms": self.ooms, "host_syncs": self.host_syncs,
                **({"simulated_rollout_peak_bytes": self.rollout_peak, "analytic_rollout_peak_bytes":
                    self.analytic_rollout} if self.analytic_rollout else {}),
                "launches": self.launches, "host_cpu_s": round(self.host_cpu_s, 4), "host_cpu_machine": self.machine,
                "roofline": self.speed.to_json() if self.speed else None}


@contextlib.contextmanager
def _simulated_world(world: int, nodes: int) -> Iterator[None]:
    """Rank 0 of `world` on the fake group (one process: a HashStore, no peers), the simulated host buffers and
    no seeded init; everything restored after."""
    import shardtune.trainer.parallelize as par
    import shardtune.trainer.train as train
    from shardtune.data.pipeline import build_data
    from shardtune.model import context_parallel

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(max(1, world // nodes))}
    saved_env = {k: os.environ.get(k) for k in env}
    F = torch.nn.functional
    saved = (accelerator.make_host_buffer, par.init_into_shards, train.prepare_for_ranks, F.scaled_dot_product_attention)
    os.environ.update(env)
    fsdp2_storage = _report_fsdp2_resizes()
    F.scaled_dot_product_attention = _cuda_sdpa
    accelerator.make_host_buffer = _host_empty
    par.init_into_shards = lambda *a, **k: None
    # Rank 0 builds the data alone: the ranks' agreement on the cache runs over a gloo group with real peers.
    train.prepare_for_ranks = lambda cfg, tok, *, seed, output_dir, rank: build_data(cfg, tok, seed=seed,
                                                                                    output_dir=output_dir)
    simulated_device.install()
    alone = standing_in_for_world()  # the hybrid groups made during setup too: no peers to match against
    alone.__enter__()
    dist.init_process_group(accelerator.SIM_BACKEND, store=dist.HashStore(), rank=0, world_size=world)
    accelerator.init_host_group_alone()
    try:
        yield
    finally:
        alone.__exit__(None, None, None)
        # The trainer's setup enables it process-wide (model/context_parallel.py) for the world's group, gone now.
        context_parallel.disable()
        dist.destroy_process_group()
        accelerator.forget_host_group()
        (accelerator.make_host_buffer, par.init_into_shards, train.prepare_for_ranks,
         F.scaled_dot_product_attention) = saved
        fsdp2_storage()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _report_fsdp2_resizes():
    """FSDP2 (engine.backend=torch) frees and re-grows its unsharded parameters by resizing their storages in place,
    which no op reports to the tracker (our engine calls memory.storage_resized): each unit gathered would count as
    alive to the end of the step. Its two helpers report their resizes while simulating; returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    saved = (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage)

    def reporting(resize):
        def resized(tensor: torch.Tensor) -> None:
            resize(tensor)
            memory.storage_resized(tensor)
        return resized

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = reporting(saved[0])
    _fsdp_param.free_storage = reporting(saved[1])

    def undo() -> None:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = saved
    return undo


def simulate(recipe_ref: str, overrides: list[str] | None = None) -> Simulation:
    """One training step of the recipe on the simulated GPU; its peak beside the analytic plan's."""
    from shardtune.config.load import load_recipe
    from shardtune.engine.state_dict import init_optimizer_state
    from shardtune.plan.planner import make_plan
    from shardtune.simulated.allocator import AllocatorTracker
    from shardtune.simulated.launches import LaunchCounter
    from shardtune.trainer.train import setup, train_step

    overrides = list(overrides or [])
    plan = make_plan(recipe_ref, overrides)
    # The simulated step starts after setup: FSDP2's whole-model load (a setup phase, estimate.fsdp2_load_phase)
    # is not in it, so the step's phases are what it is compared with.
    analytic = max(v for k, v in plan.estimate.phases.items() if k != "load")
    analytic_rollout = max((v for k, v in plan.estimate.phases.items() if k in ROLLOUT_PHASES), default=0)
    world, nodes, analytic_host = plan.setup.world, plan.setup.nodes, plan.estimate.host_per_rank
    # What the caching allocator can take from the GPU: its memory less what the CUDA context holds.
    limit = None if plan.hardware.is_cpu else plan.capacity - CUDA_CONTEXT
    grad_accum = plan.recipe.train.grad_accum
    micro = min(2, grad_accum)
    s = plan.setup
    card = load_profile(plan.recipe.hardware.gpu)  # a CPU recipe too: what a GPU would wait on
    tokens = s.micro_batch * s.local_seq * s.grad_accum * s.world  # every rank's, per optimizer step
    link = card.intra_node_gbps if s.nodes == 1 else card.inter_node_gbps
    del plan, s  # its model skeleton is meta too: the tracker would count it
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, _simulated_world(world, nodes):
        recipe = load_recipe(recipe_ref, [*overrides, f"train.grad_accum={micro}", f"train.output_dir={tmp}"])
        with contextlib.redirect_stdout(sys.stderr):  # a run's notices (data passes, epochs): --json's stdout is JSON
            run = setup(recipe, simulated=True)
        init_optimizer_state(run.optimizer)  # the steady state: AdamW's moments exist from the first step on
        # No per-op recheck of every big storage (4x the step's time at 8B): the engine reports each in-place resize
        # (memory.storage_resized / free_storage); FSDP2's through _report_fsdp2_resizes.
        tracker = AllocatorTracker(host=_is_host, recheck_min_bytes=memory.recheck_min_bytes(resizes_reported=True),
                                   device_limit=limit).start()
        rollout_peak = _peak_after_before_step(run, tracker)
        counter = LaunchCounter(micro)
        try:
            run.model.train()
            accelerator.TRACE.clear()
            # the step as the recipe runs it (train.profile_memory is a run's own tracker)
            with counter:
                train_step(run, run.objective.first_full_step(), None)
            syncs = [f"{kind} {caller}" for kind, caller in accelerator.host_syncs()]
        finally:
            tracker.stop()
        assert counter.micro == micro, (counter.micro, micro)  # each micro-step's backward was seen to end
        bare_cpu_s = _bare_cpu_s(run, train_step)
        device_peak, host_peak = tracker.peak_bytes(), tracker.host_peak_bytes()
        books = (tracker.device.peak_allocated, tracker.device.peak_reserved, tracker.pinned.peak_reserved,
                 tracker.device.alloc_retries, tracker.device.ooms)
        del run
    launches = counter.per_step(grad_accum)
    host_cpu_s = bare_cpu_s * launches["total"] / max(1, launches["counted"])
    return Simulation(world=world, device_peak=device_peak, host_peak=host_peak, analytic=analytic,
                      analytic_host=analytic_host,
                      wall_s=time.perf_counter() - t0, micro_steps=micro, allocated_peak=books[0],
                      reserved_peak=books[1], pinned_reserved_peak=books[2], alloc_retries=books[3],
                      ooms=books[4], rollout_peak=rollout_peak[0] if analytic_rollout else 0,
                      analytic_rollout=analytic_rollout, host_syncs=syncs, launches=launches, host_cpu_s=host_cpu_s,
                      machine=_machine(), speed=roofline.step_time(card, launches, tokens=tokens, link_gbps=link))


# Bare steps timed after the counted one: the fastest of up to BARE_STEPS, taken while their CPU time stays under
# BARE_BUDGET_S (a 70B step takes seconds: one). A single step read up to 2x its best on these shared cores (the
# first after the counted step pays for warm caches), and `host_cpu_s` is what ours-vs-FSDP2 ratios are made of.
BARE_STEPS, BARE_BUDGET_S = 3, 0.5


def _bare_cpu_s(run: Any, train_step: Any) -> float:
    """Process CPU seconds of the fastest bare step (no counter, no tracker) of `run`."""
    best, spent, step = float("inf"), 0.0, run.objective.first_full_step() + 1
    for i in range(BARE_STEPS):
        cpu0 = time.process_time()
        train_step(run, step + i, None)
        took = time.process_time() - cpu0
        best, spent = min(best, took), spent + took
        if spent >= BARE_BUDGET_S:
            break
    return best


def _peak_after_before_step(run: Any, tracker: Any) -> list[int]:
    """[the tracker's peak when the step's before_step first returns]: GRPO's rollout (sampling, log-probs), before
    the first micro-step. Read through a wrapper on this run's objective."""
    seen = [0]
    inner = run.objective.before_step

    def measured(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        seen[0] = seen[0] or tracker.peak_bytes()
        return out

    run.objective.before_step = measured
    return seen


def _machine() -> str:
    """What the host CPU seconds were measured on."""
    return f"this machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"


def summary(sim: Simulation) -> str:
    gib = 2 ** 30
    line = (f"simulated step (rank 0 of {sim.world}, {sim.micro_steps} micro-step(s) on the simulated GPU): peak "
            f"{sim.device_peak / gib:.2f} GiB vs plan {sim.analytic / gib:.2f} GiB (ratio {sim.ratio:.3f})")
    if sim.analytic_rollout:
        line += f"; rollout (sampling) {sim.rollout_peak / gib:.2f} GiB vs plan {sim.analytic_rollout / gib:.2f} GiB"
    if sim.host_peak or sim.analytic_host:
        line += f"; host {sim.host_peak / gib:.2f} GiB vs plan {sim.analytic_host / gib:.2f} GiB"
    line += f"; CUDA's caching allocator would reserve {sim.reserved_peak / gib:.2f} GiB"
    if sim.alloc_retries:
        oom = f", {sim.ooms} out of memory" if sim.ooms else ""
        line += f" (freeing its cache {sim.alloc_retries}x to make room{oom})"
    if sim.pinned_reserved_peak:
        line += f", its pinned host pool {sim.pinned_reserved_peak / gib:.2f} GiB"
    line += f"; {len(sim.host_syncs)} host sync(s); {sim.wall_s:.1f} s"
    n = sim.launches
    if not n or sim.speed is None:
        return line
    phases = ", ".join(f"{k} {v:,}" for k, v in n["by_phase"].items())
    return (f"{line}\nper optimizer step: {n['total']:,} kernel launches ({phases}); host CPU {sim.host_cpu_s:.2f} s "
            f"({sim.machine})\n{sim.speed.line()}")
