"""`shardtune slurm`: the script it writes, what it refuses, and `train` inside an allocation (no cluster needed)."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shardtune.config.load import load_recipe, load_recipe_config
from shardtune.errors import UserError
from shardtune.launcher.slurm import apply_allocation, rendezvous_port
from tests.unit.cli_helpers import run_cli


def slurm_cli(tmp_path, capsys, *args: str) -> tuple[int, str, str, Path]:
    out = tmp_path / "job.sbatch"
    code, stdout, stderr = run_cli(["slurm", *args, "-o", str(out)], capsys)
    return code, stdout, stderr, out


def test_script_has_the_job_and_the_same_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "train.max_steps=7", "train.output_dir=runs/x",
                                  "--nodes", "3", "--partition", "gpu", "--time", "1:30:00", "--account", "proj")
    assert code == 0, err
    text = out.read_text()
    for line in ["#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1:30:00", "#SBATCH --account=proj", "#SBATCH --output=%x-%j.out",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --chdir={tmp_path.resolve()}", "# export NCCL_DEBUG=WARN"]:
        assert line in text, line
    # The venv that wrote the script runs it; recipe and overrides pass through; the run dir is pinned (requeue).
    assert f"{Path(sys.executable).with_name('shardtune')} train tiny-cpu" in text
    # The data is tokenized once, by one task with the same overrides, before the training step starts.
    prepare = text.index(f"srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 \\\n  "
                         f"{Path(sys.executable).with_name('shardtune')} prepare tiny-cpu")
    assert prepare < text.index(" train tiny-cpu") and "train.max_steps=7" in text[prepare:text.index(" train tiny-cpu")]
    assert "train.max_steps=7" in text and f"train.output_dir={(tmp_path / 'runs/x').resolve()}" in text
    assert "launch.nproc_per_node=2" in text and "launch.device=cpu" in text  # tiny-cpu: 2 CPU workers per node
    assert "(cpu, world 6)" in text and "rtx4090" not in text  # planned on host memory, not the recipe's GPU
    # Rendezvous at the first node of the allocation, port from the job id (the same formula as in Python).
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert "RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 10000 ))" in text and rendezvous_port(123) == 20123
    assert 'launch.nnodes="$SLURM_JOB_NUM_NODES" launch.rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "trap forward_usr1 USR1" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # valid shell
    assert out.stat().st_mode & 0o111 and "sbatch" in err


def test_gpus_per_node_sets_workers_and_device(tmp_path, capsys):
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "launch.device=auto", "launch.nproc_per_node=auto",
                                  "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0, err
    text = out.read_text()
    assert "#SBATCH --gpus-per-node=8" in text and "launch.nproc_per_node=8" in text and "launch.device=cuda" in text
    assert "--cpus-per-task" not in text  # no host threads asked for: the cluster's default


def test_gpu_job_reserves_the_host_threads_it_asks_for(tmp_path, capsys):
    """launch.threads_per_worker on a GPU job (issue 20, finding 7): the workers' threads need CPUs in the job."""
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "launch.device=auto", "launch.nproc_per_node=auto",
                                  "engine.cpu_offload=true", "launch.threads_per_worker=4", "--nodes", "2",
                                  "--gpus-per-node", "8")
    assert code == 0, err
    assert "#SBATCH --cpus-per-task=32" in out.read_text()


# Usage errors (--nodes 0, --nodes zero) are typer's, tested in tests/integration/test_cli_usage.py.
@pytest.mark.parametrize("args,needle", [
    (["train.lr=-1", "--nodes", "2"], "train.lr"),  # a bad recipe never becomes a job
    (["trian.lr=1", "--nodes", "2"], "unknown recipe key"),
    (["--nodes", "2", "--time", "soon"], "--time"),
    (["--nodes", "2", "--gpus-per-node", "4"], "launch.device=cpu"),  # tiny-cpu pins the CPU
    (["launch.device=cuda", "--nodes", "2"], "--gpus-per-node"),
    (["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=3", "--nodes", "2"], "hybrid_shard_size"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, needle):
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_plan_refuses_a_job_that_does_not_fit_unless_forced(tmp_path, capsys, monkeypatch):
    seen = {}

    class FakePlan:
        def __init__(self, recipe):
            seen["world"] = (recipe.launch.nproc_per_node, recipe.launch.nnodes)

        def to_json(self):
            return {"fits": False, "per_rank": {"total_bytes": 30 * 2**30}, "capacity_bytes": 24 * 2**30,
                    "world_size": 4, "hardware": "rtx4090-24gb", "advice": ["engine.cpu_offload=true"]}

    fake = types.ModuleType("shardtune.plan")  # check_fits calls shardtune.plan.plan_recipe(recipe).to_json()
    fake.plan_recipe = FakePlan
    monkeypatch.setitem(sys.modules, "shardtune.plan", fake)
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "--nodes", "2")
    assert code == 2 and "does NOT fit" in err and "--force" in err and "cpu_offload" in err, err
    assert not out.exists() and seen["world"] == (2, 2)  # plan saw the job's world: 2 nodes x 2 workers
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "--nodes", "2", "--force")
    assert code == 0 and "# plan: does NOT fit: 30.00 GiB" in out.read_text()


def test_multinode_without_endpoint_is_a_user_error(tmp_path, capsys):
    code, _, err = run_cli(["train", "tiny-cpu", "launch.nnodes=2", f"train.output_dir={tmp_path}"], capsys)
    assert code == 2 and "launch.rdzv_endpoint" in err and len(err.strip().splitlines()) == 1, err


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NODELIST": "node[1-2]"}


def test_train_inside_srun_takes_nodes_and_rendezvous_from_slurm(monkeypatch):
    import shardtune.launcher.slurm

    monkeypatch.setattr(shardtune.launcher.slurm, "head_node_addr", lambda env: "10.1.2.3")
    cfg = apply_allocation(load_recipe_config("tiny-cpu"), SLURM_STEP)
    assert cfg.launch.nnodes == 2 and cfg.launch.rdzv_endpoint == "10.1.2.3:24242"
    explicit = load_recipe_config("tiny-cpu", ["launch.nnodes=2", "launch.rdzv_endpoint=h:1"])
    assert apply_allocation(explicit, SLURM_STEP).launch.rdzv_endpoint == "h:1"  # the user's choice wins
    plain = load_recipe_config("tiny-cpu")
    assert apply_allocation(plain, {}) is plain  # outside SLURM: unchanged
    with pytest.raises(UserError, match="--ntasks-per-node=1"):
        apply_allocation(plain, {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "16"})


def test_restarts_inside_srun_host_the_store_at_this_nodes_slurm_address(monkeypatch):
    import shardtune.launcher.slurm
    from shardtune.config.load import to_recipe
    from shardtune.launcher.launch import torchrun_command

    monkeypatch.setattr(shardtune.launcher.slurm, "head_node_addr", lambda env: "10.1.2.3")
    monkeypatch.setattr(shardtune.launcher.slurm, "node_addr", {"node2": "10.1.2.4"}.__getitem__)
    step = {**SLURM_STEP, "SLURMD_NODENAME": "node2"}
    cfg = apply_allocation(load_recipe_config("tiny-cpu", ["launch.max_restarts=1"]), step)
    assert cfg.launch.local_addr == "10.1.2.4"
    cmd = torchrun_command(to_recipe(cfg), Path("r.yaml"), 2)
    assert "--local-addr=10.1.2.4" in cmd and "--rdzv-endpoint=10.1.2.3:24242" in cmd
    # without restarts the workers' store is the rendezvous endpoint's: torchrun's default stays
    assert apply_allocation(load_recipe_config("tiny-cpu"), step).launch.local_addr is None
    mine = load_recipe_config("tiny-cpu", ["launch.max_restarts=1", "launch.local_addr=ib0-node2"])
    assert apply_allocation(mine, step).launch.local_addr == "ib0-node2"  # the user's choice wins


def test_hybrid_shard_defaults_to_one_node(monkeypatch):
    from shardtune.model.build import build_model
    from shardtune.trainer.parallelize import sharding_policy

    recipe = load_recipe("tiny-cpu", ["engine.strategy=hybrid_shard"])
    model = build_model(recipe.model, seed=0, device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks on this node, world of 4 = 2 nodes
    assert sharding_policy(recipe, model, world_size=4).hybrid_shard_size == 2
    explicit = load_recipe("tiny-cpu", ["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=4"])
    assert sharding_policy(explicit, model, world_size=4).hybrid_shard_size == 4
