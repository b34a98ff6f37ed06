"""The launcher process reads the recipe, runs the pre-flight plan and starts torchrun. Importing transformers there
cost every `shardtune train` ~3 s before a worker started (and torch+transformers ~5 s: a 6-step CLI run 22.4 s ->
17.0 s without them). The pre-flight plan needs torch (meta tensors, plan/skeleton.py) but not transformers; checking
a recipe (validate, check_launch) needs neither."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from shardtune.config.load import load_recipe_config, to_recipe
from shardtune.launch import check_launch, torchrun_command
from shardtune.slurm import apply_allocation
import shardtune.cli
cfg = apply_allocation(load_recipe_config("tiny-cpu", ["engine.strategy=hybrid_shard"]))
recipe = to_recipe(cfg)
nproc = check_launch(recipe)
heavy = ("torch", "transformers", "peft", "datasets", "accelerate")
print(sorted(m for m in heavy if m in sys.modules))
from shardtune.preflight import preflight
cfg, code = preflight(cfg, recipe, nproc, refuse=True, fit=True)
print(code, sorted(m for m in heavy if m in sys.modules))
"""


def test_launcher_path_imports_no_ml_library_and_preflight_no_transformers():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[]", out.stdout
    assert lines[-1] == "0 ['torch']", out.stdout
