"""`shardtune plan RECIPE --max-seq` through the installed executable: the printed length fits in `plan` and the
next multiple of 128 does not; the long-context options raise it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardtune.plan import make_plan

EXE = Path(sys.executable).with_name("shardtune")
RECIPE = "llama-3.1-8b-lora-1x24gb"
LONG = ["engine.offload_activations=true", "engine.mlp_chunk_tokens=4096"]  # the recipe checkpoints already


def _max_seq(*overrides: str) -> dict:
    r = subprocess.run([str(EXE), "plan", RECIPE, *overrides, "--max-seq", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_max_seq_is_the_fitting_boundary():
    plain, long = _max_seq(), _max_seq(*LONG)
    n = plain["max_seq_len"]
    assert n % 128 == 0 and n > 0
    assert make_plan(RECIPE, [f"data.seq_len={n}"]).fits
    assert not make_plan(RECIPE, [f"data.seq_len={n + 128}"]).fits
    assert plain["peak_bytes"] <= plain["capacity_bytes"] and plain["host_bytes"] == 0
    # Offloaded unit inputs and the chunked MLP: a longer sequence, and the offloaded inputs on the host
    assert long["max_seq_len"] > 2 * n and long["host_bytes"] > 0
