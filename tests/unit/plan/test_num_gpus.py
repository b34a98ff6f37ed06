"""hardware.num_gpus means one thing everywhere: the job's GPUs, all nodes together. `shardtune keys` says so, every
recipe's comment says so, and `plan` takes it as the world size (launch.nproc_per_node=auto)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.bundled import RECIPES_DIR
from shardtune.plan import make_plan

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))


def test_keys_and_recipes_say_what_plan_does_with_num_gpus() -> None:
    out = subprocess.run([SHARDTUNE, "keys", "hardware.num_gpus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "all nodes together" in out.stdout and "per node" not in out.stdout, out.stdout
    # Two nodes, 8 GPUs in all: plan's world is 8 ranks, 4 per node (it was "GPUs per node" in keys: 16)
    plan = make_plan("llama-3.1-8b-lora-1x24gb", ["launch.nnodes=2", "hardware.num_gpus=8", "engine.strategy=full_shard"])
    assert (plan.setup.world, plan.setup.nodes, plan.to_json()["world_size"]) == (8, 2, 8)
    # every bundled recipe's comment on the key says the same
    lines = [(p.name, ln) for p in sorted(RECIPES_DIR.rglob("*.yaml")) for ln in p.read_text().splitlines()
             if re.match(r"\s*num_gpus:", ln)]
    assert lines
    assert all(ln.split("#", 1)[-1].strip() == "all nodes together" for _, ln in lines), lines


@pytest.mark.parametrize("overrides,gpus,nodes", [(["launch.nnodes=3"], 2, 3),
                                                  (["launch.nnodes=2", "hardware.num_gpus=3"], 3, 2)])
def test_gpus_that_do_not_split_over_the_nodes_are_one_line(overrides, gpus, nodes) -> None:
    """Issue 59's repeat probe: 2 GPUs over 3 nodes planned "world 2 (3 node(s))", a job no launcher can start
    (each node runs the same number of workers)."""
    from shardtune.errors import UserError

    with pytest.raises(UserError) as e:
        make_plan("mistral-7b-lora-2x24gb", overrides)
    assert str(e.value) == (f"hardware.num_gpus={gpus} (the job's GPUs, all nodes together) does not split evenly "
                            f"over launch.nnodes={nodes}: set hardware.num_gpus to a multiple of {nodes}, or "
                            "launch.nproc_per_node to the GPUs per node")
