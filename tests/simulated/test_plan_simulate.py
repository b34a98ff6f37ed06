"""`shardtune plan RECIPE --simulate` (issue 20): one real training step of a bundled GPU recipe at its full size
(Llama-3.1-8B, LoRA, bf16, checkpointing, seq 2048) on the simulated GPU, through the installed executable; its
measured peak must agree with the analytic plan within 5 % (bench/RESULTS.md has the table for every recipe)."""
from __future__ import annotations

import json
from pathlib import Path

from tests.integration.runs import cli

REPO = Path(__file__).resolve().parents[2]


def test_simulated_step_agrees_with_the_plan() -> None:
    out = cli("plan", "recipes/hardware/llama-3.1-8b-lora-1x24gb.yaml", "--simulate", "--json",
                        cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["world_size"] == 1 and sim["micro_steps"] == 2
    # The simulated bytes are real allocations: more than the frozen bf16 base alone (8B x 2 bytes = 14.96 GiB).
    assert sim["simulated_peak_bytes"] > 8.0e9 * 2
    assert abs(sim["simulated_peak_bytes"] / sim["analytic_peak_bytes"] - 1) <= 0.05, sim
