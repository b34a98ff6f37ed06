"""`plan --simulate` under cpu_offload on a GPU: the pinned host pool CUDA would hold (simulated/allocator.py) and the
host bytes, against the plan. Shards and gradient landing buffers are pinned at their exact size
(accelerator.host_resident), so the pool holds what the plan counts, not power-of-two blocks.

Through the installed executable: the suite's `plan --simulate` runs from a fresh interpreter (the other
`--simulate` tests fork the CLI from the preloaded server, tests/integration/runs.py `forked_cli`)."""
from __future__ import annotations

import json
from pathlib import Path

from tests.integration.runs import cli

REPO = Path(__file__).resolve().parents[2]


def _simulate(*args: str) -> dict:
    out = cli("plan", *args, "launch.device=cuda", "hardware.gpu=rtx4090-24gb", "--simulate", "--json", cwd=REPO,
              timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_lora_offload_pins_exactly_the_planned_host_bytes() -> None:
    """LoRA + offload: the host holds the frozen base's shards only, every byte pinned, none rounded up."""
    sim = _simulate("recipes/tiny-lora-cpu.yaml")
    assert sim["simulated_host_bytes"] > 0
    assert sim["pinned_reserved_peak_bytes"] == sim["simulated_host_bytes"] == sim["analytic_host_bytes"], sim


def test_full_offload_host_agrees_with_the_plan() -> None:
    """Full fine-tuning + offload over 2 micro-steps (row-sharded tables, the default): shards, each unit's and
    table's gradient buffers (a second one for the later micro-step's copy) and AdamW's pageable moments, as the
    plan counts them; the pinned pool is that less the moments (8 bytes per trainable element of the shard)."""
    sim = _simulate("recipes/tiny-cpu.yaml", "engine.cpu_offload=true", "train.grad_accum=2")
    assert abs(sim["simulated_host_bytes"] - sim["analytic_host_bytes"]) <= 0.01 * sim["analytic_host_bytes"], sim
    assert 0 < sim["pinned_reserved_peak_bytes"] < sim["simulated_host_bytes"], sim
