"""`shardtune train`: validate, save the resolved recipe, then start workers through torchrun.

Inside an existing torchrun/srun worker (RANK and WORLD_SIZE set) the worker runs directly. A worker that hits
a user error writes it to `<run>/.user_error` (--error-file) and exits 2; the launcher then prints that one line and exits 2
instead of relaying torchrun's failure report (bad input never gives a traceback). A worker that dies without a
message (a signal, a native crash) is one line from the agent's report (launcher/agent.py, trainer/worker_deaths.py), exit 5.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from shardtune.checkpoint.paths import explicit_resume_dir
from shardtune.config.load import to_recipe, to_yaml
from shardtune.config.schema import Recipe, check_world
from shardtune.disk import check_dir_creatable, write_text_atomic
from shardtune.errors import UserError
from shardtune.launcher.run_lock import RunLock
from shardtune.plan.model_limits import check_model_limits
from shardtune.trainer.worker_deaths import (
    checkpoint_line,
    describe,
    first_failure,
    last_traceback,
    rank_log,
    read_report,
)

USER_ERROR_FILE = ".user_error"
EXIT_CODE_FILE = ".exit_code"  # a worker's documented exit code (preempted 75, diverged 4) survives torchrun


def in_worker_env() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def workers_per_node(recipe: Recipe) -> int:
    n = recipe.launch.nproc_per_node
    if recipe.launch.device_type() == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("launch.device=cuda but no CUDA GPU is visible: use launch.device=cpu or auto")
        gpus = torch.cuda.device_count()
        if n != "auto" and n > gpus:
            raise UserError(f"launch.nproc_per_node={n} but only {gpus} GPU(s) are present: set it to {gpus} or less")
        return gpus if n == "auto" else n
    return 2 if n == "auto" else n


def check_launch(recipe: Recipe) -> int:
    """Everything we can check before a process starts; returns workers per node."""
    nproc = workers_per_node(recipe)
    check_world(recipe, nproc * recipe.launch.nnodes, nproc)
    if recipe.launch.nnodes > 1 and not recipe.launch.rdzv_endpoint:
        raise UserError("launch.nnodes > 1 needs launch.rdzv_endpoint=HOST:PORT (the first node's address)")
    explicit_resume_dir(recipe.train.resume)  # a bad path fails here, not after the workers have started
    check_run_dirs(recipe)
    return nproc


def check_run_dirs(recipe: Recipe) -> None:
    """The folders a run writes can be made (the run directory, the tokenized cache): one line naming the key."""
    check_dir_creatable(recipe.train.output_dir, "train.output_dir")
    if recipe.data.cache_dir:
        check_dir_creatable(recipe.data.cache_dir, "data.cache_dir")


def worker_threads(recipe: Recipe, nproc: int) -> int | None:
    """OMP_NUM_THREADS for each worker, or None to leave torchrun's choice (1 per worker when nproc > 1).

    `launch.threads_per_worker` wins on every device, then an OMP_NUM_THREADS the user exported (torchrun honours
    it too: a machine shared with other jobs, a container's CPU quota). Default: on CPU the cores shared out
    (oversubscription halves speed); on a GPU with engine.cpu_offload the same, because the host then runs AdamW,
    the gradient adds and norms, which torchrun's one thread per worker would serialise; a GPU run without offload
    does little host math and keeps torchrun's default."""
    if recipe.launch.threads_per_worker:
        return recipe.launch.threads_per_worker
    exported = os.environ.get("OMP_NUM_THREADS", "")
    if exported.isdigit() and int(exported) >= 1:
        return int(exported)
    if recipe.launch.device_type() == "cpu" or recipe.engine.cpu_offload:
        return max(1, (os.cpu_count() or 2) // nproc)
    return None


def torchrun_command(recipe: Recipe, recipe_file: Path, nproc: int, report: Path | None = None) -> list[str]:
    """torchrun's arguments, run by launcher/agent.py (torchrun's agent, reporting how failed workers ended to `report`)."""
    launch = recipe.launch
    cmd = [sys.executable, "-m", "shardtune.launcher.agent", str(report or os.devnull), f"--nproc-per-node={nproc}",
           f"--max-restarts={launch.max_restarts}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={launch.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}",
                f"--rdzv-id={os.environ.get('SLURM_JOB_ID', 'shardtune')}"]
        if launch.node_rank is not None:
            cmd.append(f"--node-rank={launch.node_rank}")
        if launch.local_addr:
            cmd.append(f"--local-addr={launch.local_addr}")
    error_file = Path(recipe.train.output_dir) / USER_ERROR_FILE
    return cmd + ["-m", "shardtune.trainer.worker", str(recipe_file), f"--error-file={error_file}"]


def _forward_stop_signals(proc: subprocess.Popen) -> None:
    """A stop signal to the launcher reaches every worker, which finishes the step, checkpoints and exits (75, or
    130 for SIGINT) saying which signal it got. SIGTERM goes to torchrun's agent, which passes it on. SIGINT and
    SIGUSR1 go to the workers themselves: the agent ignores both (SIGINT so that Ctrl-C, which a terminal sends to
    every process of the group, stops the workers gracefully instead of the agent killing them). Without /proc
    to find the workers, the agent gets SIGTERM."""

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is not None:
            return
        workers = _children(proc.pid) if signum != signal.SIGTERM else []
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if not workers:
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; [] elsewhere)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def launch_train(cfg: DictConfig, *, check: bool = True, fit: bool = False, trust_host_ram: bool = False) -> int:
    """`check`: refuse (exit 3) a recipe the plan says does not fit the detected hardware; `fit`: apply
    `plan --fit`'s fastest fitting configuration first (launcher/preflight.py); `trust_host_ram`: hardware.host_ram_gb was
    given on the command line, so pre-flight believes it over /proc/meminfo."""
    if not in_worker_env():
        from shardtune.launcher.slurm import apply_allocation

        cfg = apply_allocation(cfg)  # inside `srun`, one task per node: nodes and rendezvous from SLURM
    recipe = to_recipe(cfg)
    if in_worker_env():  # the launcher (or the user) already checked: workers never re-run the plan
        from shardtune.trainer.worker import run_worker

        if fit:
            print("warning: --fit is ignored inside torchrun/srun workers: run `shardtune train RECIPE --fit` "
                  "outside them, or pass the overrides `shardtune plan RECIPE --fit` lists", file=sys.stderr)
        return run_worker(recipe)
    nproc = check_launch(recipe)
    from shardtune.trainer.trackers import tracker_problems

    missing = tracker_problems(recipe.train.report_to)
    if missing:  # before any worker starts
        raise UserError(missing[0])
    check_model_limits(recipe)
    if recipe.launch.is_first_node():  # the nodes read the same files: one refusal, before any worker starts
        from shardtune.data.check import check_data_head

        check_data_head(recipe.data)
        from shardtune.trainer.rewards import reward_problem

        rewards = reward_problem(recipe)  # a reward column or file missing: refused here, not in every rank
        if rewards:
            raise UserError(rewards)
    header = ""
    if check or fit:
        from shardtune.launcher.preflight import preflight

        before = to_yaml(cfg)
        cfg, code = preflight(cfg, recipe, nproc, refuse=check, fit=fit, trust_host_ram=trust_host_ram)
        if code:
            return code
        if fit and to_yaml(cfg) != before:
            recipe = to_recipe(cfg)
            nproc = check_launch(recipe)
            header = "# engine/train settings chosen by `shardtune train --fit` (plan --fit's fastest fitting one)\n"
    # Held from before the run directory is read (resume checks) until the workers are gone.
    with RunLock(Path(recipe.train.output_dir)) if recipe.launch.is_first_node() else contextlib.nullcontext():
        return _start(cfg, recipe, nproc, header)


def prepare_run_dir(cfg: DictConfig, recipe: Recipe, nproc: int, header: str = "") -> tuple[Recipe, Path]:
    """Check the run directory against the recipe and write recipe.yaml: what the workers read (and the tests that
    start `run_worker` on forked ranks instead of through torchrun)."""
    from shardtune.checkpoint.resume_check import check_rerun, check_resume
    from shardtune.launcher.finished_run import check_finished_run

    cfg = check_resume(cfg, recipe, nproc * recipe.launch.nnodes)  # exit 2 for a checkpoint of another run
    check_rerun(cfg)  # exit 2 for a finished run of other data, without a checkpoint
    recipe = to_recipe(cfg)
    check_finished_run(recipe)  # exit 2 for a finished run of this recipe, without a checkpoint
    run_dir = Path(recipe.train.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_file = run_dir / "recipe.yaml"
    write_text_atomic(recipe_file, header + to_yaml(cfg))  # resolved: every default and override: reproducible
    (run_dir / USER_ERROR_FILE).unlink(missing_ok=True)
    (run_dir / EXIT_CODE_FILE).unlink(missing_ok=True)
    return recipe, recipe_file


def _start(cfg: DictConfig, recipe: Recipe, nproc: int, header: str) -> int:
    """Check the run directory against the recipe, write recipe.yaml, run the agent; the run's exit code."""
    recipe, recipe_file = prepare_run_dir(cfg, recipe, nproc, header)
    run_dir = Path(recipe.train.output_dir)
    env = dict(os.environ)
    threads = worker_threads(recipe, nproc)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if recipe.launch.max_restarts > 0:
        # torchrun's workers share the agent's store by default, and that store outlives a restart: the new
        # workers would read the dead attempt's gloo/NCCL addresses under the same keys and fail with "Connection
        # refused" (pytorch/pytorch#167288). Unshared, rank 0 of each attempt hosts a fresh store on a new port.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # SLURM delivers a step's signals to every process in it: torchrun's agent has no USR1 handler and would die
    # (killing the workers mid-checkpoint), so it inherits SIG_IGN from here; the workers set their own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with tempfile.TemporaryDirectory(prefix="shardtune-agent-") as tmp:  # per node: not in a shared run dir
        report = Path(tmp) / "failures.json"
        code = _run_agent(torchrun_command(recipe, recipe_file, nproc, report), env, run_dir)
        failures = read_report(report)
    err_file = run_dir / USER_ERROR_FILE
    if code != 0 and err_file.exists():
        raise UserError(err_file.read_text().strip())
    code_file = run_dir / EXIT_CODE_FILE
    if code != 0 and code_file.exists():  # torchrun reports 1 for any failed worker; keep the worker's reason
        worker_code, message = code_file.read_text().split("\n", 1)
        print(f"shardtune: {message}", file=sys.stderr)
        return int(worker_code)
    if code != 0 and failures:
        return _report_death(failures, recipe, nproc * recipe.launch.nnodes)
    return code


def _run_agent(cmd: list[str], env: dict[str, str], run_dir: Path) -> int:
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    _forward_stop_signals(proc)
    assert proc.stderr is not None
    said = (run_dir / USER_ERROR_FILE, run_dir / EXIT_CODE_FILE)
    for line in proc.stderr:  # relay live, but drop the agent's last words once a worker has said what was wrong
        if not any(f.exists() for f in said):
            sys.stderr.write(line)
    return proc.wait()


def _report_death(failures: list[dict], recipe: Recipe, world_size: int) -> int:
    """One line for the first worker that died, ending with the checkpoint a relaunch continues from and the exact
    command (this one, sys.argv); an internal error also shows its traceback (from its log)."""
    run_dir = Path(recipe.train.output_dir)
    code, line = describe(failures, run_dir, world_size)
    if code == 1:
        sys.stderr.write(last_traceback(rank_log(run_dir, first_failure(failures, run_dir)["rank"])))
    saved = checkpoint_line(run_dir, sys.argv[1:], resume=recipe.train.resume, save_every=recipe.train.save_every)
    print(f"shardtune: {line}; {saved}", file=sys.stderr)
    return code
