"""Whole training runs for numeric checks (losses after a resume, what a checkpoint holds) without the CLI's start-up.

`shardtune train` costs ~13 s before its first step on 2 idle cores: the launcher, torchrun's agent and each worker
import torch and transformers anew. Here the launcher's own pre-start code (launch.prepare_run_dir: the resume and
rerun checks, recipe.yaml) runs in this process, and `worker.run_worker` on ranks forked from the test suite's
preloaded server (tests/distributed/harness.py), with the threads per worker the launcher would give them. What
the launcher and torchrun add on top (signals, restarts, exit codes, one-line errors) stays with the CLI tests.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.distributed.harness import start_ranks
from tests.integration.runs import console_to_files


@dataclass(frozen=True)
class Run:
    code: int  # the exit code `shardtune train` would have (run_worker's)
    launcher_err: str  # what the launcher's checks printed (the resume notices)
    out: str  # rank 0's stdout
    err: str  # rank 0's stderr


def train(recipe: str | Path, *overrides: str, world: int = 2, env: dict[str, str] | None = None) -> Run:
    """`shardtune train RECIPE OVERRIDES` on `world` forked ranks; train.output_dir must be among the overrides.
    The ranks see `env`, by default this process's environment at the call (as a subprocess would; the rank
    server's is the one it started with)."""
    from shardtune.config.load import load_recipe_config, to_recipe
    from shardtune.launcher.launch import prepare_run_dir
    from shardtune.trainer.runtime import free_port

    cfg = load_recipe_config(str(recipe), [*overrides, f"launch.nproc_per_node={world}"])
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        resolved, recipe_file = prepare_run_dir(cfg, to_recipe(cfg), world)
    logs = Path(resolved.train.output_dir) / "forked"
    logs.mkdir(exist_ok=True)
    start_ranks(_rank, (world, free_port(), str(recipe_file), str(logs), dict(os.environ) if env is None else env),
                world)
    read = lambda name: (logs / name).read_text() if (logs / name).exists() else ""  # noqa: E731
    return Run(code=int(read("code")), launcher_err=said.getvalue(), out=read("out"), err=read("err"))


def train_on_one_rank(recipe: str | Path, *overrides: str) -> Run:
    """The recipe's global batch on one forked rank: micro_batch_size x nproc_per_node rows per micro-step. For the
    tests that check what a run learns (the recipe's optimisation, step for step): two ranks would add a second
    process's per-step overhead on a 2-core machine, and that N ranks compute what one does is the parity grids'
    job (tests/distributed)."""
    from shardtune.config.load import load_recipe_config, to_recipe

    shipped = to_recipe(load_recipe_config(str(recipe), list(overrides)))
    rows = shipped.train.micro_batch_size * shipped.launch.nproc_per_node * shipped.launch.nnodes
    return train(recipe, *overrides, f"train.micro_batch_size={rows}", world=1)


def _rank(rank: int, world: int, port: int, recipe_file: str, logs: str, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 0:  # the console of rank 0 is what a user reads (the other ranks print nothing of their own)
        console_to_files(logs)
    import torch

    from shardtune.config.load import load_recipe
    from shardtune.launcher.launch import worker_threads
    from shardtune.trainer.worker import run_worker

    recipe = load_recipe(recipe_file)
    torch.set_num_threads(worker_threads(recipe, world) or 1)  # the launcher's OMP_NUM_THREADS
    code = run_worker(recipe)
    if rank == 0:
        (Path(logs) / "code").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
