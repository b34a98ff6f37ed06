"""engine.compile: what it cannot compile yet is refused by validate in one line (exit 2) naming the key and the
fix, never run eagerly in silence; the default recipe with it set validates, and so do QLoRA, MoE and packed rows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config.load import load_recipe
from tests.unit.cli_helpers import run_cli

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
UNPACKED = ["engine.compile=true", "data.packing=false"]
REFUSED = [
    ("tiny-cpu", [*UNPACKED, "engine.mlp_chunk_tokens=16"], "set engine.mlp_chunk_tokens=0 or engine.compile=false"),
    ("tiny-cpu", [*UNPACKED, "engine.context_parallel=true", "model.attn_implementation=eager"],
     "context parallelism's collectives"),
]


@pytest.mark.parametrize("recipe,overrides,says", REFUSED, ids=lambda v: str(v))
def test_what_compile_cannot_trace_is_refused_in_one_line(recipe, overrides, says, capsys):
    code, out, err = run_cli(["validate", recipe, *overrides], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, (out, err)
    assert "engine.compile" in lines[0] and says in lines[0], lines[0]


def test_installed_executable_refuses_mlp_chunks_under_compile():
    done = subprocess.run([SHARDTUNE, "validate", "tiny-cpu", "engine.compile=true", "engine.mlp_chunk_tokens=16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "engine.compile" in done.stderr and "set engine.mlp_chunk_tokens=0 or engine.compile=false" in done.stderr


@pytest.mark.parametrize("recipe", ["tiny-cpu", "tiny-qlora-cpu", "tiny-moe-cpu"])
@pytest.mark.parametrize("packing", ["true", "false"])
def test_off_by_default_and_dense_qlora_moe_validate_packed_or_not(recipe, packing, capsys):
    """QLoRA's NF4 matmuls, the experts' grouped matmul and packed rows' attention compile as custom ops
    (torch.library ops: model/experts.py, engine/nf4_linear.py): accepted."""
    assert load_recipe(recipe, []).engine.compile is False
    code, out, err = run_cli(["validate", recipe, "engine.compile=true", f"data.packing={packing}"], capsys)
    assert code == 0, (out, err)


def test_the_cpu_memory_tracker_under_compile_is_a_user_error():
    """train.profile_memory on CPU is a dispatch mode (memory.py), which dynamo cannot trace under: the worker says
    so in one line (a UserError, exit 2) before the first step, instead of a traceback from inside dynamo."""
    import torch

    from shardtune.errors import UserError
    from shardtune.trainer.train import _memory_tracker

    with pytest.raises(UserError, match=r"^train\.profile_memory: .* set train\.profile_memory=false or engine\."):
        _memory_tracker(True, torch.device("cpu"), "shardtune", compiled=True)
    tracker = _memory_tracker(True, torch.device("cpu"), "shardtune", compiled=False)  # eager: measured as before
    assert tracker is not None
    tracker.stop()
