"""`shardtune plan RECIPE --simulate` on the two Qwen3-30B-A3B recipes (128 experts, top-8), through the
CLI's `main` (forked, tests/integration/runs.py `forked_cli`): one training step on the simulated GPU at full
width and 8 of the 48 layers (tests/simulated/shallow.py; full depth: bench/RESULTS.md, 1.013 and 1.005), its measured peak within 5 % of the analytic plan. QLoRA on one GPU: NF4 experts dequantized a run at a time; LoRA on 2 GPUs: the bf16 base offloaded,
activation checkpointing (a MoE layer's recompute holds the un-permute's rows, plan/moe.py unpermute_bytes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.runs import forked_cli
from tests.simulated.shallow import shallow_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["qwen3-30b-a3b-qlora-1x24gb", "qwen3-30b-a3b-lora-2x24gb"])
def test_moe_recipe_simulates_as_planned(recipe: str, tmp_path: Path) -> None:
    out = forked_cli("plan", recipe, shallow_config(recipe, 8, tmp_path), "--simulate", "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["simulated_peak_bytes"] > 4e9  # real allocations were counted (8 layers' experts and tables)
    assert abs(sim["simulated_peak_bytes"] / sim["analytic_peak_bytes"] - 1) <= 0.05, sim
    assert abs(sim["simulated_host_bytes"] - sim["analytic_host_bytes"]) <= 0.01 * max(1, sim["analytic_host_bytes"]), sim
