"""`plan` on a CPU recipe (launch.device=cpu) checks host memory, as train's pre-flight does: hardware.host_ram_gb,
else the RAM present, shared by the node's workers. It checked an RTX 4090 (the schema's default hardware.gpu), in the
text, the JSON and the --png chart's title."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from shardtune.config.load import load_recipe, load_recipe_config
from shardtune.launcher import preflight
from shardtune.plan import make_plan
from shardtune.plan.hardware import host_ram_bytes
from shardtune.plan.report import plan_figure

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
GiB = 1 << 30


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDTUNE, "plan", "tiny-cpu", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300"})


def test_plan_of_a_cpu_recipe_checks_host_memory(tmp_path: Path) -> None:
    present = host_ram_bytes()
    out = _plan("--png", str(tmp_path / "plan.png"))
    assert out.returncode == 0, out.stderr
    assert "4090" not in out.stdout and "capacity less CUDA context" not in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("fits: "))
    assert f"GiB host memory, {present / GiB:.1f} GiB per node / 2 workers;" in line, line
    assert f"capacity (host memory, {present / GiB:.1f} GiB per node / 2 workers)" in out.stdout
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    # --json: the recipe's hardware.host_ram_gb when set, each of the node's 2 workers gets half
    out = _plan("hardware.host_ram_gb=8", "--json")
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert (j["hardware"], j["capacity_bytes"], j["usable_bytes"]) == ("cpu", 4 * GiB, 4 * GiB)
    assert j["capacity_of"] == "host memory, 8.0 GiB per node / 2 workers"


def test_plan_and_the_preflight_judge_a_cpu_run_alike() -> None:
    """The pre-flight's plan on what it detects (launcher/preflight.py) and `plan`'s: the same capacity."""
    plan = make_plan("tiny-cpu")
    found = preflight.detect(load_recipe("tiny-cpu"))
    checked = preflight.plan_on_detected(load_recipe_config("tiny-cpu"), load_recipe("tiny-cpu"), 2, found)
    assert plan.hardware.is_cpu and plan.capacity == checked.capacity == host_ram_bytes() // 2
    assert plan.checks_against == checked.checks_against


def test_png_title_names_host_memory_and_phase_labels_do_not_overlap() -> None:
    fig = plan_figure(make_plan("tiny-cpu", ["hardware.host_ram_gb=8"]))
    ax = fig.axes[0]
    assert ax.get_title() == "tiny-llama: fits in host memory, 8.0 GiB per node / 2 workers"
    gpu = plan_figure(make_plan("llama-3.1-70b-lora-4x24gb"))
    assert gpu.axes[0].get_title() == "llama-3.1-70b: fits on 4 x rtx4090-24gb"
    for f in (fig, gpu):  # nine phases; their names on one line overlapped (forward-loss / loss-backward / ...)
        f.canvas.draw()
        labels = f.axes[0].get_xticklabels()
        assert len(labels) == 9
        boxes = [t.get_window_extent(f.canvas.get_renderer()) for t in labels]
        assert not [(a.get_text(), b.get_text()) for (a, x), (b, y) in itertools.combinations(zip(labels, boxes), 2)
                    if x.overlaps(y)]
