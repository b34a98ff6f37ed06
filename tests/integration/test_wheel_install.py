"""A non-editable install (the wheel) finds the bundled recipes and configs with no repository around it.

recipes/ and configs/ live at the repository's top level and setup.py maps them into the package at build time;
a mistake there shows only in a wheel, never in the editable install the rest of the suite runs on. The wheel goes
into a fresh venv that downloads nothing: it is made without pip, the wheel is installed into it with --no-deps by
this interpreter's pip, and a .pth line gives it this venv's site-packages for the dependencies (a plain path
line does not run the editable install's finder, so the wheel's own shardtune is the one imported).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the build reads; copied so that the build's build/ and *.egg-info stay out of the work tree.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "src", "recipes", "configs")


# The suite's own src/ (PYTHONPATH, when set) must not leak into the build, the install or the venv.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(cmd: list, *, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def test_wheel_installed_outside_the_repository_finds_bundled_recipes(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
          source], cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("shardtune-*.whl"))

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    site = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel],
         cwd=tmp_path)
    # After the install: seen before it, the shared venv's editable shardtune would count as already installed.
    (site / "shared-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run([venv / "bin" / "python", "-c", "import shardtune, shardtune.bundled as b; "
                  "print(shardtune.__file__); print(b.RECIPES_DIR)"], cwd=tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the wheel's copy, not the repository's

    listed = _run([venv / "bin" / "shardtune", "recipes"], cwd=tmp_path).stdout
    for name in ("tiny-cpu", "tiny-lora-cpu", "llama-3.1-70b-lora-4x24gb"):
        assert name in listed, listed
    ok = _run([venv / "bin" / "shardtune", "validate", "tiny-cpu"], cwd=tmp_path).stdout
    assert ok.startswith("ok: tiny-cpu"), ok
