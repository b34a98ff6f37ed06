"""The launcher process only reads the recipe and starts torchrun: importing torch/transformers there cost every
`shardtune train` ~5 s before a worker started (measured: a 6-step CLI run 22.4 s -> 17.0 s without them)."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from shardtune.config.load import load_recipe_config, to_recipe
from shardtune.launch import check_launch, torchrun_command
from shardtune.slurm import apply_allocation
import shardtune.cli
recipe = to_recipe(apply_allocation(load_recipe_config("tiny-cpu", ["engine.strategy=hybrid_shard"])))
check_launch(recipe)
print(sorted(m for m in ("torch", "transformers", "peft", "datasets") if m in sys.modules))
"""


def test_launcher_path_imports_no_ml_library():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


HELP_AND_USAGE_ERRORS = """
import sys
from shardtune.cli import main
for argv in (["--help"], ["plan", "--help"], ["train", "--bogus"], ["slurm", "x", "--nodes", "zero"], ["bogus"]):
    sys.argv = ["shardtune", *argv]
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, 2), (argv, e.code)
print(sorted(m for m in ("torch", "transformers", "peft", "datasets") if m in sys.modules), file=sys.stderr)
"""


def test_help_and_usage_errors_import_no_ml_library():
    # Only `--version` may pay for torch: help and a typo must answer as fast as Python starts.
    out = subprocess.run([sys.executable, "-c", HELP_AND_USAGE_ERRORS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
