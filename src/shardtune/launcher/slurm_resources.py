"""What a `shardtune slurm` job asks SLURM for per node besides nodes and GPUs: CPUs, memory, and how long before
the time limit the batch shell gets USR1 (`--signal=B:USR1@SECONDS`). Derived from the recipe and from `plan` for
the job's world; each formula, with its numbers, goes into the script's header so the user can check it.

CPUs (`--cpus-per-task`, one task per node)
    GPU job: workers x threads + NODE_EXTRA_CPUS. threads = launch.threads_per_worker, default GPU_WORKER_THREADS:
    each worker's Python thread launching kernels, NCCL's proxy thread, and its torch threads for host math
    (cpu_offload's AdamW and gradient adds). The extra CPUs are for the launcher and torchrun's agent. `prepare`
    (the data step before training) runs its tokenizers on the same CPUs (data.num_proc auto: one per core).
    The workers get the threads the job reserved (launch.threads_per_worker passed on): their own default under
    cpu_offload counts the node's cores, not the job's share. CPU job: workers x (launch.threads_per_worker or 1),
    as before. `--cpus-per-task` overrides both.
Memory (`--mem`, per node)
    --mem rather than --exclusive: a 2-GPU job on an 8-GPU node leaves the other 6 schedulable, and a cluster's
    per-CPU default (DefMemPerCPU, often 2-4 GB) would give a 10-CPU job too little for the weight load.
        mem = HOST_MARGIN x plan's host bytes per node + workers x WORKER_HOST + NODE_EXTRA_HOST
    plan's host bytes: cpu_offload's states and pinned buffers (GPU job), the workers' peaks (CPU job: the host is
    their device). WORKER_HOST is what plan does not count: each worker's Python, torch and CUDA libraries and
    context, torch.compile's workers, and the loader's piece in flight (model/loading.py reads piece by piece).
    `--mem` overrides it (0: all of the node's memory).
Warning time (`--signal=B:USR1@W`)
    On USR1 the workers finish the optimizer step they are in, write a checkpoint and exit; all of it must end
    before the time limit:
        W = max(SIGNAL_FLOOR_S, ceil(SIGNAL_MARGIN x (step_s + checkpoint_bytes / CHECKPOINT_WRITE_BPS)))
    step_s: plan's predicted optimizer step (plan/search.py step_time, what `plan --fit` ranks by); the margin
    because that model ranks configurations, it is not a benchmark. checkpoint_bytes: 12 per trainable parameter
    (fp32 master and AdamW's two fp32 moments, engine/state_dict.py; a frozen base is never saved).
    CHECKPOINT_WRITE_BPS: 1 GB/s, one job's share of a shared filesystem; a faster one only makes the warning early
    (minutes of an allocation), a slower one would lose the checkpoint.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardtune.config.schema import Recipe
from shardtune.errors import UserError

GiB = 1 << 30
GPU_WORKER_THREADS = 4
NODE_EXTRA_CPUS = 2
HOST_MARGIN = 1.1
WORKER_HOST_GPU = 6 * GiB
WORKER_HOST_CPU = 1 * GiB
NODE_EXTRA_HOST = 2 * GiB  # the launcher and torchrun's agent
CHECKPOINT_BYTES_PER_PARAM = 12
CHECKPOINT_WRITE_BPS = 1e9
SIGNAL_MARGIN = 2.0
SIGNAL_FLOOR_S = 120  # what every job got before: the shell's trap, srun's forwarding, the requeue
SIGNAL_MAX_S = 65535  # SLURM's limit for --signal's time


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    """What `plan` predicts for the job's world that the job's requests are made of."""

    verdict: str  # plan's one line: fits / does NOT fit, peak per rank of capacity
    host_bytes: int  # per node: offloaded states (GPU job), the workers' peaks (CPU job)
    step_s: float  # one optimizer step
    checkpoint_bytes: int  # one checkpoint, all ranks together


@dataclass(frozen=True, kw_only=True)
class Resources:
    cpus_per_task: int
    threads_per_worker: int | None  # for the workers' launch.threads_per_worker (None: the recipe's own)
    mem: str | None  # --mem's value, e.g. 14G (None: no plan to size it from)
    signal_s: int
    header: list[str]  # the script's comment lines saying how each was derived


def check_mem(mem: str | None) -> None:
    if mem is not None and not re.fullmatch(r"\d+[KMGT]?", mem):
        raise UserError(f"--mem '{mem}' is not a SLURM size: write MEGABYTES or a number with K, M, G or T "
                        "(e.g. 64G; 0 = all of the node's memory)")


def time_limit_s(time: str) -> int:
    """A SLURM time limit in seconds: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS or
    DAYS-HOURS[:MINUTES[:SECONDS]]."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def checkpoint_bytes(trainable_params: int) -> int:
    return CHECKPOINT_BYTES_PER_PARAM * trainable_params


def job_resources(recipe: Recipe, *, workers: int, gpu: bool, figures: PlanFigures | None,
                  cpus_per_task: int | None = None, mem: str | None = None) -> Resources:
    """The job's per-node requests; `cpus_per_task` and `mem` are the user's overrides."""
    cpus, threads, cpu_line = _cpus(recipe.launch.threads_per_worker, workers, gpu, cpus_per_task)
    mem, mem_line = _memory(figures, workers, gpu, mem)
    signal_s, signal_lines = _signal(figures)
    return Resources(cpus_per_task=cpus, threads_per_worker=threads, mem=mem, signal_s=signal_s,
                     header=[f"Per node: {cpu_line};", f"  memory {mem_line}.", *signal_lines])


def _cpus(threads: int | None, workers: int, gpu: bool, override: int | None) -> tuple[int, int | None, str]:
    """(CPUs per node, launch.threads_per_worker to pass on or None, how)."""
    if override is not None:
        if override < workers:
            raise UserError(f"--cpus-per-task {override} is fewer than the {workers} workers per node: give at "
                            f"least {workers}")
        passed = max(1, (override - NODE_EXTRA_CPUS) // workers) if gpu and threads is None else None
        how = f"; {passed} threads per worker" if passed else ""
        return override, passed, f"{override} CPUs (--cpus-per-task{how})"
    if not gpu:
        cpus = workers * (threads or 1)
        return cpus, None, f"{cpus} CPUs = {workers} workers x {threads or 1} threads"
    per = threads or GPU_WORKER_THREADS
    cpus = workers * per + NODE_EXTRA_CPUS
    return cpus, None if threads else per, (f"{cpus} CPUs = {workers} workers x {per} threads + {NODE_EXTRA_CPUS} "
                                            "(launcher, torchrun's agent)")


def _memory(figures: PlanFigures | None, workers: int, gpu: bool, override: str | None) -> tuple[str | None, str]:
    """(--mem's value or None, how)."""
    if override is not None:
        return override, f"{override} (--mem)"
    if figures is None:
        return None, "not requested (plan unavailable)"
    worker = WORKER_HOST_GPU if gpu else WORKER_HOST_CPU
    mem = f"{math.ceil((HOST_MARGIN * figures.host_bytes + workers * worker + NODE_EXTRA_HOST) / GiB)}G"
    return mem, (f"{mem} = {HOST_MARGIN:g} x {figures.host_bytes / GiB:.2f} GiB (plan's host RAM per node) + "
                 f"{workers} workers x {worker // GiB} GiB + {NODE_EXTRA_HOST // GiB} GiB (launcher)")


def _signal(figures: PlanFigures | None) -> tuple[int, list[str]]:
    """(seconds before the time limit, how)."""
    what = "USR1 to this shell {} s before the time limit (--signal=B:...): the workers finish the step,"
    if figures is None:
        return SIGNAL_FLOOR_S, [what.format(SIGNAL_FLOOR_S), "  checkpoint and the job requeues (plan unavailable "
                                "to size the time)."]
    write_s = figures.checkpoint_bytes / CHECKPOINT_WRITE_BPS
    seconds = min(SIGNAL_MAX_S, max(SIGNAL_FLOOR_S, math.ceil(SIGNAL_MARGIN * (figures.step_s + write_s))))
    return seconds, [what.format(seconds),
                     f"  checkpoint and the job requeues; {seconds} s = max({SIGNAL_FLOOR_S}, {SIGNAL_MARGIN:g} x "
                     f"({figures.step_s:.1f} s per step (plan) + {figures.checkpoint_bytes / 1e9:.2f} GB checkpoint "
                     f"at {CHECKPOINT_WRITE_BPS / 1e9:g} GB/s))."]
