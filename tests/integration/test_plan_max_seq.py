"""`shardtune plan RECIPE --max-seq` through the installed executable: the printed length fits in `plan` and the
next multiple of 128 does not; the long-context options (offloaded unit inputs, the chunked MLP) raise it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardtune.plan import make_plan
from shardtune.plan.long_context import at_seq, max_seq

EXE = Path(sys.executable).with_name("shardtune")
RECIPE = "llama-3.1-8b-lora-1x24gb"  # checkpointing on already
LONG = ["engine.offload_activations=true", "engine.mlp_chunk_tokens=4096"]


def test_max_seq_is_the_fitting_boundary():
    r = subprocess.run([str(EXE), "plan", RECIPE, *LONG, "--max-seq", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    n = out["max_seq_len"]
    assert n % 128 == 0 and out["peak_bytes"] <= out["capacity_bytes"] and out["host_bytes"] > 0
    long = make_plan(RECIPE, LONG)
    assert at_seq(long, n).fits and not at_seq(long, n + 128).fits
    plain, _ = max_seq(make_plan(RECIPE))
    assert 0 < 2 * plain < n  # the offloaded inputs and the chunked MLP more than double it
