"""The launcher process reads the recipe, runs the pre-flight check and starts torchrun. Importing torch+transformers
there cost every `shardtune train` ~5 s before a worker started (a 6-step CLI run 22.4 s -> 17.0 s without them).
Checking a recipe (validate, check_launch) needs neither; the pre-flight of a recipe far under capacity neither
(plan/bound.py); the full plan (near capacity, `--fit`) needs torch (meta tensors, plan/skeleton.py), not
transformers."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from shardtune.config.load import load_recipe_config, to_recipe
from shardtune.launcher.launch import check_launch, torchrun_command
from shardtune.launcher.slurm import apply_allocation
import shardtune.launcher.cli
cfg = apply_allocation(load_recipe_config("tiny-cpu", ["engine.strategy=hybrid_shard"]))
recipe = to_recipe(cfg)
nproc = check_launch(recipe)
heavy = ("torch", "transformers", "peft", "datasets", "accelerate")
print(sorted(m for m in heavy if m in sys.modules))
from shardtune.launcher.preflight import preflight
print(preflight(cfg, recipe, nproc, refuse=True, fit=False)[1], sorted(m for m in heavy if m in sys.modules))
print(preflight(cfg, recipe, nproc, refuse=True, fit=True)[1], sorted(m for m in heavy if m in sys.modules))
"""


def test_launcher_path_imports_no_ml_library_and_preflight_no_transformers():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[]", out.stdout
    assert lines[2] == "0 []", out.stdout  # far under capacity: plan/bound.py decides, torch-free
    assert lines[-1] == "0 ['torch']", out.stdout  # --fit needs the plan itself


HELP_AND_USAGE_ERRORS = """
import sys
from shardtune.launcher.cli import main
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


EVERY_LAUNCHER_MODULE = """
import importlib, pkgutil, sys
import shardtune.launcher as launcher
names = sorted(m.name for m in pkgutil.iter_modules(launcher.__path__, "shardtune.launcher."))
for name in names:
    importlib.import_module(name)
print(len(names), sorted(m for m in ("torch", "transformers", "peft", "datasets", "accelerate") if m in sys.modules))
"""


def test_the_launcher_package_imports_no_ml_library():
    # The launcher package is torch-free at import: its commands import torch inside, when they need it.
    out = subprocess.run([sys.executable, "-c", EVERY_LAUNCHER_MODULE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, heavy = out.stdout.strip().split(" ", 1)
    assert int(count) >= 10 and heavy == "[]", out.stdout
