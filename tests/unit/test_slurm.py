"""`shardtune slurm`: the script it writes, what it refuses, and `train` inside an allocation (no cluster needed)."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shardtune.config.load import load_recipe, load_recipe_config
from shardtune.errors import UserError
from shardtune.launcher.slurm import apply_allocation, rendezvous_port
from shardtune.launcher.slurm_resources import time_limit_s
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
                 "#SBATCH --cpus-per-task=2",  # a CPU job: its 2 workers x 1 thread, as before
                 "#SBATCH --mem=5G",  # 1.1 x 2 workers' planned peak (~0.05 GiB each) + 2 x 1 GiB + 2 GiB
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
    # A stop by USR1 saves at any save_every (trainer/signals.py): the script and the note say so, and what is lost.
    assert "(at any train.save_every) and exit 75" in text
    assert "a job warned by USR1 still saves" in err and "restarts from step 0" in err


def test_gpus_per_node_sets_workers_and_device(tmp_path, capsys):
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "launch.device=auto", "launch.nproc_per_node=auto",
                                  "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0, err
    text = out.read_text()
    assert "#SBATCH --gpus-per-node=8" in text and "launch.nproc_per_node=8" in text and "launch.device=cuda" in text
    # Issue 59 item 7: CPUs and memory for the 8 workers, not the cluster's default of one CPU per task.
    assert "#SBATCH --cpus-per-task=34" in text  # 8 workers x 4 threads + 2 (launcher, torchrun's agent)
    assert "launch.threads_per_worker=4" in text  # the workers use the threads the job reserved
    assert "#SBATCH --mem=50G" in text  # no offload: plan's host bytes 0, + 8 workers x 6 GiB + 2 GiB
    assert "#SBATCH --gres" not in text and "--constraint" not in text


def test_gpu_job_reserves_the_host_threads_it_asks_for(tmp_path, capsys):
    """launch.threads_per_worker on a GPU job (issue 20, finding 7): the workers' threads need CPUs in the job."""
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "launch.device=auto", "launch.nproc_per_node=auto",
                                  "engine.cpu_offload=true", "launch.threads_per_worker=4", "--nodes", "2",
                                  "--gpus-per-node", "8")
    assert code == 0, err
    assert "#SBATCH --cpus-per-task=34" in out.read_text()  # 8 x 4 + 2: the launcher and torchrun's agent
    # the user's own, in the "Written by" line, prepare and train: not passed a second time
    assert out.read_text().count("launch.threads_per_worker=4") == 3


def test_gpu_type_constraint_and_overrides_reach_the_script(tmp_path):
    """Through the installed executable: the options exist on the command line users type."""
    out = tmp_path / "job.sbatch"
    proc = subprocess.run([str(Path(sys.executable).with_name("shardtune")), "slurm", "tiny-cpu", "launch.device=auto",
                           "launch.nproc_per_node=auto", "--nodes", "2", "--gpus-per-node", "4", "--gpu-type", "a100",
                           "--constraint", "a100&ib", "--cpus-per-task", "20", "--mem", "300G", "-o", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for line in ["#SBATCH --gpus-per-node=a100:4", "#SBATCH --constraint=a100&ib", "#SBATCH --cpus-per-task=20",
                 "#SBATCH --mem=300G", "# Per node: 20 CPUs (--cpus-per-task; 4 threads per worker);",
                 "#   memory 300G (--mem)."]:
        assert line in text, line
    assert "launch.threads_per_worker=4" in text  # (20 - 2) // 4 workers
    assert "--gpu-type a100 --constraint 'a100&ib' --cpus-per-task 20 --mem 300G" in text  # "Written by" line
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def _signal_s(text: str) -> int:
    return int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M).group(1))


# plan --fit's fastest fitting configuration for the 70B QLoRA recipe (107 s per step, issue 59 item 7)
FIT_70B = ["engine.strategy=full_shard", "engine.activation_checkpointing=true", "engine.cpu_offload=true",
           "train.micro_batch_size=8", "train.grad_accum=2", "engine.backward_schedule=overlap"]


@pytest.mark.parametrize("overrides", [[], FIT_70B], ids=["recipe", "fit-pick"])
def test_warning_time_covers_a_step_and_a_checkpoint_write(tmp_path, capsys, overrides):
    """The fixed 120 s was shorter than one step of the 70B QLoRA recipe: the USR1 warning now comes from plan's
    step time and the checkpoint's bytes (12 per trainable parameter, written at 1 GB/s), twice over."""
    from shardtune.plan import plan_recipe
    from shardtune.plan.search import step_time

    code, _, err, out = slurm_cli(tmp_path, capsys, "llama-3.1-70b-qlora-2x24gb", *overrides, "--nodes", "1",
                                  "--gpus-per-node", "2", "--force")
    assert code == 0, err
    text = out.read_text()
    plan = plan_recipe(load_recipe("llama-3.1-70b-qlora-2x24gb", [*overrides, "launch.nproc_per_node=2",
                                                                  "launch.device=cuda"]))
    step_s = step_time(plan)["step_s"]
    write_s = 12 * plan.to_json()["model"]["trainable_params"] / 1e9
    # a step long enough that twice it beats the fixed 120 s: ~181 s (recipe) or ~94 s (fit pick, since the NF4
    # lookup and LoRA launch cuts of issue 58); 103.5 M adapter params
    assert step_s > 60 and 1 < write_s < 2
    signal_s = _signal_s(text)
    assert signal_s > step_s + write_s and signal_s == math.ceil(2 * (step_s + write_s)), (signal_s, step_s)
    assert f"{signal_s} s = max(120, 2 x ({step_s:.1f} s per step (plan) + {write_s:.2f} GB checkpoint at 1 GB/s))" \
        in text
    assert f"# USR1 to this shell {signal_s} s before the time limit" in text


def test_memory_comes_from_the_plans_host_bytes(tmp_path, capsys):
    """cpu_offload's states live in host RAM: --mem holds plan's host bytes per node, not a cluster default."""
    from shardtune.plan import plan_recipe

    code, _, err, out = slurm_cli(tmp_path, capsys, "llama-3.1-405b-lora-4x8x80gb", "--nodes", "4",
                                  "--gpus-per-node", "8")
    assert code == 0, err
    host = plan_recipe(load_recipe("llama-3.1-405b-lora-4x8x80gb", [
        "launch.nproc_per_node=8", "launch.device=cuda", "launch.nnodes=4", "launch.rdzv_endpoint=h:1"
    ])).to_json()["host"]["total_bytes"]
    assert host > 500 * 2**30  # the offloaded 405B base: hundreds of GiB per node
    gib = math.ceil((1.1 * host + 8 * 6 * 2**30 + 2 * 2**30) / 2**30)
    assert f"#SBATCH --mem={gib}G" in out.read_text()


def test_a_time_limit_under_the_warning_is_said(tmp_path, capsys):
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "--nodes", "2", "--time", "1")
    assert code == 0 and "warning: --time 1 is not longer than the USR1 warning (120 s)" in err, err
    assert time_limit_s("1") == 60 and time_limit_s("1:30:00") == 5400 and time_limit_s("2-3") == 183600
    assert time_limit_s("10:30") == 630 and time_limit_s("1-0:1:2") == 86462


# Usage errors (--nodes 0, --nodes zero) are typer's, tested in tests/integration/test_cli_usage.py.
@pytest.mark.parametrize("args,needle", [
    (["train.lr=-1", "--nodes", "2"], "train.lr"),  # a bad recipe never becomes a job
    (["trian.lr=1", "--nodes", "2"], "unknown recipe key"),
    (["--nodes", "2", "--time", "soon"], "--time"),
    (["--nodes", "2", "--gpus-per-node", "4"], "launch.device=cpu"),  # tiny-cpu pins the CPU
    (["launch.device=cuda", "--nodes", "2"], "--gpus-per-node"),
    (["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=3", "--nodes", "2"], "hybrid_shard_size"),
    (["launch.device=auto", "--nodes", "2", "--gpu-type", "a100"], "--gpus-per-node"),
    (["launch.device=auto", "--nodes", "2", "--gpus-per-node", "2", "--gpu-type", "a100 x"], "--gpu-type"),
    (["--nodes", "2", "--constraint", "a100 ib"], "--constraint"),
    (["--nodes", "2", "--mem", "lots"], "--mem"),
    (["launch.device=auto", "launch.nproc_per_node=auto", "--nodes", "2", "--gpus-per-node", "4",
      "--cpus-per-task", "3"], "--cpus-per-task"),  # fewer CPUs than workers
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
                    "world_size": 4, "hardware": "rtx4090-24gb", "advice": ["engine.cpu_offload=true"],
                    "host": {"total_bytes": 0}, "model": {"trainable_params": 10**9}}

    fake = types.ModuleType("shardtune.plan")  # check_fits calls shardtune.plan.plan_recipe(recipe).to_json()
    fake.plan_recipe = FakePlan
    search = types.ModuleType("shardtune.plan.search")  # ... and plan/search.py's step_time(plan)
    search.step_time = lambda plan: {"step_s": 300.0}
    monkeypatch.setitem(sys.modules, "shardtune.plan", fake)
    monkeypatch.setitem(sys.modules, "shardtune.plan.search", search)
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "--nodes", "2")
    assert code == 2 and "does NOT fit" in err and "--force" in err and "cpu_offload" in err, err
    assert not out.exists() and seen["world"] == (2, 2)  # plan saw the job's world: 2 nodes x 2 workers
    code, _, err, out = slurm_cli(tmp_path, capsys, "tiny-cpu", "--nodes", "2", "--force")
    assert code == 0 and "# plan: does NOT fit: 30.00 GiB" in out.read_text()
    assert _signal_s(out.read_text()) == 2 * (300 + 12)  # the plan's step and 12 GB of checkpoint at 1 GB/s


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
