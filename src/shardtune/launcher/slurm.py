"""`shardtune slurm`: write an sbatch script that trains a recipe on N nodes, with preemption and requeue.

The job is one SLURM task per node. `srun` starts `shardtune train` on every node with the launch keys set for
a multi-node c10d rendezvous, so each node runs torchrun exactly as `launcher/launch.py` builds it (the same validation,
recipe.yaml and one-line user errors as a local run):

    batch shell (node 1) --srun--> node k: shardtune train ... --> torchrun --rdzv-id=$SLURM_JOB_ID --> workers

Resources per node (CPUs, memory, the USR1 warning time): slurm_resources.py, from the recipe and `plan`.

Preemption: `--signal=B:USR1@W` (and `scancel --signal=USR1 --batch`) reach only the batch shell. Its trap
forwards USR1 to the step through srun, which delivers it to every process of the step: the workers save a
checkpoint and exit; the launcher and torchrun's agent ignore USR1 (launcher/launch.py). The shell then runs
`scontrol requeue`, and the requeued job (same job id, same run directory, log appended) resumes from the
latest checkpoint (`train.resume=auto`).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig

from shardtune.config.load import load_recipe, resolve_recipe_path
from shardtune.config.schema import Recipe, check_world
from shardtune.errors import UserError
from shardtune.launcher.slurm_resources import (
    PlanFigures,
    check_mem,
    checkpoint_bytes,
    job_resources,
    time_limit_s,
)

# c10d rendezvous port = RDZV_PORT_BASE + job id % RDZV_PORT_SPAN: two jobs sharing a head node get different
# ports, a requeued job (same id) gets its old one back. 20000-29999 stays below Linux's ephemeral range (32768+).
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
CPU_WORKERS_DEFAULT = 2  # launch.nproc_per_node=auto without GPUs: the same default as launcher/launch.py


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None  # SLURM time limit, e.g. 04:00:00 or 2-00:00:00
    account: str | None = None
    job_name: str | None = None
    gpu_type: str | None = None  # GRES type: --gpus-per-node=TYPE:G
    constraint: str | None = None  # node features: --constraint=...
    cpus_per_task: int | None = None  # overrides the derived CPUs per node (slurm_resources.py)
    mem: str | None = None  # overrides the derived memory per node

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UserError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", self.time):
            raise UserError(f"--time '{self.time}' is not a SLURM time: write MINUTES, HH:MM:SS or D-HH:MM:SS")
        if self.gpu_type is not None:
            if not self.gpus_per_node:
                raise UserError(f"--gpu-type {self.gpu_type} names the type of the job's GPUs: add --gpus-per-node G")
            if not re.fullmatch(r"[\w.-]+", self.gpu_type):
                raise UserError(f"--gpu-type '{self.gpu_type}' is not a GPU type name: write the cluster's name for it "
                                "as `sinfo -o %G` lists it, e.g. a100")
        if self.constraint is not None and not re.fullmatch(r"[^\s'\"#]+", self.constraint):
            raise UserError(f"--constraint '{self.constraint}' holds a space or quote: write features as SLURM "
                            "does, e.g. a100&ib or [rack1|rack2]")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise UserError(f"--cpus-per-task must be >= 1, got {self.cpus_per_task}")
        check_mem(self.mem)


def rendezvous_port(job_id: int) -> int:
    """The port the generated script computes in bash (keep the two in step)."""
    return RDZV_PORT_BASE + job_id % RDZV_PORT_SPAN


def shardtune_executable() -> list[str]:
    """The `shardtune` of this very environment (absolute), so the job runs the venv that wrote the script."""
    exe = Path(sys.executable).with_name("shardtune")
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [sys.executable, "-m", "shardtune.launcher.cli"]


def job_launch_keys(recipe: Recipe, job: SlurmJob) -> dict[str, str]:
    """Per-node workers and device for the job, fixed at generation time (the login node may have no GPU)."""
    launch = recipe.launch
    if job.gpus_per_node:
        if launch.device == "cpu":
            raise UserError("launch.device=cpu with --gpus-per-node: drop --gpus-per-node or set launch.device=cuda")
        nproc = job.gpus_per_node if launch.nproc_per_node == "auto" else launch.nproc_per_node
        if nproc > job.gpus_per_node:
            raise UserError(f"launch.nproc_per_node={nproc} but --gpus-per-node={job.gpus_per_node}: "
                            f"set launch.nproc_per_node={job.gpus_per_node} or auto")
        device = "cuda"
    else:
        if launch.device == "cuda":
            raise UserError("launch.device=cuda needs GPUs in the job: pass --gpus-per-node G")
        nproc = CPU_WORKERS_DEFAULT if launch.nproc_per_node == "auto" else launch.nproc_per_node
        device = "cpu"
    check_world(recipe, nproc * job.nodes, nproc)
    return {"launch.nproc_per_node": str(nproc), "launch.device": device}


def check_fits(recipe: Recipe, *, force: bool) -> PlanFigures | None:
    """`plan` before submit: refuse a job whose predicted peak memory per rank does not fit, unless `force`.

    The recipe has the job's world (nodes x workers) fixed. Returns plan's one-line verdict and the figures the
    job's requests are sized from, or None when the `shardtune.plan` package is not installed (the script then
    says "plan: not checked").
    """
    try:
        from shardtune.plan import plan_recipe
        from shardtune.plan.search import step_time
    except ImportError:
        return None
    plan = plan_recipe(recipe)
    report = plan.to_json()  # the `plan --json` contract
    total = report["per_rank"]["total_bytes"]
    verdict = (f"{'fits' if report['fits'] else 'does NOT fit'}: {total / 2**30:.2f} GiB peak per rank of "
               f"{report['capacity_bytes'] / 2**30:.1f} GiB ({report.get('hardware', recipe.hardware.gpu)}, "
               f"world {report['world_size']})")
    if not report["fits"] and not force:
        advice = report.get("advice") or []
        raise UserError(f"plan: the job {verdict}{'; try: ' + advice[0] if advice else ''}; "
                        f"fix the recipe, or pass --force to write the script anyway")
    # A CPU job's workers hold their peaks in host memory: the device is the host.
    workers = report["world_size"] // max(1, recipe.launch.nnodes)
    host = report["host"]["total_bytes"] + (workers * total if recipe.launch.device == "cpu" else 0)
    return PlanFigures(verdict=verdict, host_bytes=host, step_s=step_time(plan)["step_s"],
                       checkpoint_bytes=checkpoint_bytes(report["model"]["trainable_params"]))


def sbatch_script(recipe_arg: str, overrides: list[str], job: SlurmJob, *, force: bool = False,
                  cwd: Path | None = None, script_name: str = "THIS_FILE") -> tuple[str, list[str]]:
    """Validate the recipe for this job, check it fits, and return the sbatch script text and warnings."""
    cwd = (cwd or Path.cwd()).resolve()
    recipe = load_recipe(recipe_arg, overrides)  # a bad recipe never becomes a job (UserError: exit 2)
    keys = job_launch_keys(recipe, job)
    # Pin the run directory: a requeued job must resume in the same one, even if output_dir uses ${now:...}.
    keys["train.output_dir"] = str((cwd / recipe.train.output_dir).resolve())
    # A CPU job is planned against host memory (the cpu profile), never the recipe's GPU profile.
    target = ["hardware.gpu=cpu"] if keys["launch.device"] == "cpu" else []
    job_recipe = load_recipe(recipe_arg, [*overrides, *(f"{k}={v}" for k, v in keys.items()),
                                          f"launch.nnodes={job.nodes}", "launch.rdzv_endpoint=head:1", *target])
    figures = check_fits(job_recipe, force=force)
    gpu = keys["launch.device"] == "cuda"
    workers = int(keys["launch.nproc_per_node"])
    res = job_resources(recipe, workers=workers, gpu=gpu, figures=figures, cpus_per_task=job.cpus_per_task,
                        mem=job.mem)
    if res.threads_per_worker is not None:  # the workers use the CPUs the job reserved (slurm_resources.py)
        keys["launch.threads_per_worker"] = str(res.threads_per_worker)

    recipe_ref = recipe_arg if not Path(recipe_arg).is_file() else str(resolve_recipe_path(recipe_arg))
    name = job.job_name or f"shardtune-{resolve_recipe_path(recipe_arg).stem}"
    args = [*overrides, *(f"{k}={v}" for k, v in keys.items())]
    train = " \\\n    ".join([shlex.join([*shardtune_executable(), "train", recipe_ref]), *map(shlex.quote, args)])
    prepare = " \\\n    ".join([shlex.join([*shardtune_executable(), "prepare", recipe_ref]), *map(shlex.quote, args)])
    sbatch = [f"--job-name={name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpu_type + ':' if job.gpu_type else ''}{job.gpus_per_node}")
    sbatch.append(f"--cpus-per-task={res.cpus_per_task}")
    if res.mem is not None:
        sbatch.append(f"--mem={res.mem}")
    sbatch += [f"--{k}={v}" for k, v in (("constraint", job.constraint), ("partition", job.partition),
                                         ("account", job.account), ("time", job.time)) if v]
    sbatch += [f"--chdir={cwd}",
               "--output=%x-%j.out", "--open-mode=append", f"--signal=B:USR1@{res.signal_s}", "--requeue"]
    header = "\n".join(f"#SBATCH {s}" for s in sbatch)
    options = [("--nodes", job.nodes), ("--gpus-per-node", job.gpus_per_node), ("--gpu-type", job.gpu_type),
               ("--constraint", job.constraint), ("--cpus-per-task", job.cpus_per_task), ("--mem", job.mem),
               ("--partition", job.partition), ("--time", job.time), ("--account", job.account)]
    command = shlex.join(["shardtune", "slurm", recipe_arg, *overrides,
                          *(x for k, v in options if v is not None for x in (k, str(v)))])
    plan_line = (f"plan: {figures.verdict}" if figures is not None
                 else "plan: not checked (shardtune.plan unavailable)")
    resources = "\n".join(f"# {line}" for line in res.header)
    warnings = []
    if job.time is not None and res.signal_s >= time_limit_s(job.time):
        warnings.append(f"warning: --time {job.time} is not longer than the USR1 warning ({res.signal_s} s): the "
                        "job would checkpoint and requeue as soon as it starts; ask for more --time")
    text = _TEMPLATE.format(header=header, script=script_name, command=command,
                            date=datetime.now().strftime("%Y-%m-%d %H:%M"), plan=plan_line, resources=resources,
                            run_dir=keys["train.output_dir"], train=train, prepare=prepare,
                            port_base=RDZV_PORT_BASE, port_span=RDZV_PORT_SPAN)
    return text, warnings


_TEMPLATE = """\
#!/bin/bash
# Written by `{command}` on {date}.
# Submit: sbatch {script}
# {plan}. Run directory: {run_dir}
# One log per job (%x-%j.out), appended to by a requeued run.
{resources}
{header}

set -uo pipefail

# NCCL on GPU clusters (uncomment what your fabric needs):
# export NCCL_DEBUG=WARN                 # INFO to debug hangs
# export NCCL_SOCKET_IFNAME=ib0          # the interface the nodes reach each other on
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# c10d rendezvous on the first node of the allocation, at the address SLURM itself uses for it; the port is
# derived from the job id so that two jobs sharing a node do not clash (and a requeued job gets the same one).
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
RDZV_PORT=$(( {port_base} + SLURM_JOB_ID % {port_span} ))
echo "shardtune: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST," \\
     "rendezvous $HEAD_ADDR:$RDZV_PORT"

# Preemption: USR1 reaches this shell (--signal=B:..., or `scancel --signal=USR1 --batch`). Forward it to the
# step: srun delivers it to every process on every node; the workers finish the step, save a checkpoint
# (at any train.save_every) and exit 75; this shell then requeues the job.
PREEMPTED=0
SRUN_PID=""  # empty while `prepare` runs: a USR1 then only marks the job for requeue
forward_usr1() {{ PREEMPTED=1; echo "shardtune: USR1: checkpointing before requeue"
                 if [ -n "$SRUN_PID" ]; then kill -USR1 "$SRUN_PID"; fi; }}
trap forward_usr1 USR1

# Tokenize the data once, on one task, before the training step: the cache lands in the run directory (or
# data.cache_dir) that every node sees, so no GPU waits on tokenization; after a requeue it is a cache hit.
srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 \\
  {prepare} || exit $?
if [ "$PREEMPTED" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi

# One task per node; each runs torchrun with launch.nproc_per_node workers (train.resume=auto picks up the
# latest checkpoint after a requeue).
srun --kill-on-bad-exit=1 \\
  {train} \\
    launch.nnodes="$SLURM_JOB_NUM_NODES" launch.rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT" &
SRUN_PID=$!
while true; do  # `wait` returns early when the trap runs: wait again until srun has really finished
  wait "$SRUN_PID"; RC=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done

if [ "$PREEMPTED" = 1 ] && [ "$RC" != 0 ]; then
  echo "shardtune: requeueing job $SLURM_JOB_ID (train exited with $RC after USR1)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$RC"
"""


def write_sbatch(recipe_arg: str, overrides: list[str], job: SlurmJob, *, out: Path | None, force: bool) -> str:
    """The CLI's body: the script to `out` (mode 755) or stdout; returns what to tell the user on stderr."""
    text, notes = sbatch_script(recipe_arg, overrides, job, force=force,
                                script_name=out.name if out else "THIS_FILE")
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        out.chmod(0o755)
        hint = "" if shutil.which("sbatch") else " (sbatch is not on this machine's PATH: copy it to the cluster)"
        notes.append(f"wrote {out}: submit with `sbatch {out}`{hint}")
    if load_recipe(recipe_arg, overrides).train.save_every == 0:
        notes.append("warning: train.save_every=0: a job warned by USR1 still saves, but one killed without warning "
                     "(a node failure, a time limit reached before the warning) restarts from step 0; "
                     "set train.save_every=N")
    return "\n".join(notes)


def apply_allocation(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> DictConfig:
    """`shardtune train` inside `srun` (no torchrun around it): take the nodes from SLURM, without flags.

    One task per node (what the generated script runs): launch.nnodes and launch.rdzv_endpoint come from the
    step (first node's address, port from the job id), unless the recipe already sets them; with restarts on,
    launch.local_addr is this node's NodeAddr. A step with several tasks per node is refused: each task would
    start its own torchrun; use --ntasks-per-node=1.
    """
    nodes = int(env.get("SLURM_STEP_NUM_NODES", "0") or 0)
    if not nodes or "SLURM_JOB_ID" not in env:
        return cfg  # not inside an srun step
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", str(nodes)) or nodes)
    if tasks != nodes:
        raise UserError(f"shardtune train runs as one SLURM task per node (it starts torchrun itself), but this "
                        f"step has {tasks} tasks on {nodes} node(s): use srun --ntasks-per-node=1")
    if nodes == 1:
        return cfg  # one node: torchrun --standalone
    cfg = cfg.copy()
    if cfg.launch.nnodes == 1 and cfg.launch.rdzv_endpoint is None:  # else the user chose the rendezvous
        head = head_node_addr(env)
        if head is None:
            raise UserError("inside a multi-node srun step but `scontrol show hostnames` failed: set "
                            "launch.nnodes and launch.rdzv_endpoint=HOST:PORT yourself")
        cfg.launch.nnodes = nodes
        cfg.launch.rdzv_endpoint = f"{head}:{rendezvous_port(int(env['SLURM_JOB_ID']))}"
    if cfg.launch.max_restarts > 0 and cfg.launch.local_addr is None and env.get("SLURMD_NODENAME"):
        # restarts host each attempt's store on rank 0's node: at the address SLURM knows it by, not getfqdn()
        cfg.launch.local_addr = node_addr(env["SLURMD_NODENAME"])
    return cfg


def head_node_addr(env: Mapping[str, str] = os.environ) -> str | None:
    """Inside an allocation: the address of the first node, as the generated script computes it."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return node_addr(hosts[0]) if hosts else None


def node_addr(name: str) -> str:
    """A node's NodeAddr from `scontrol show node` (its name when SLURM has no address for it, or fails)."""
    try:
        node = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return name
    m = re.search(r"NodeAddr=(\S+)", node)
    return m.group(1) if m else name
