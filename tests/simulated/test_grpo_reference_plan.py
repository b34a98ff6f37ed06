"""GRPO with grpo.beta > 0 under full fine-tuning: the frozen reference copy (trainer/reference.py) in the plan
(plan/grpo.py frozen_copy_bytes) and on the simulated GPU.

The copy is sharded like the policy and held for the whole run, so every phase's params grow by this rank's shard:
T / N parameters in the compute dtype on our engine (stored as a LoRA run's frozen base), in model.dtype (fp32) on
FSDP2. The tiny Llama's flat buffers are even-sized: no padding at 2 ranks (a 2-rank run measures 379,456 parameters,
1,517,824 fp32 bytes, per rank: tests/distributed/test_grpo.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.plan.planner import make_plan
from tests.integration.runs import forked_cli

REPO = Path(__file__).resolve().parents[2]
# every prompt at its budget (the tiny rows are cut to 12 tokens), as the plan assumes
TINY = ("launch.device=cuda", "hardware.gpu=rtx4090-24gb", "data.seq_len=12", "engine.vocab_parallel=false")


@pytest.mark.parametrize("overrides,itemsize", [
    ((), 4),  # fp32 on our engine
    (("engine.mixed_precision=bf16",), 2),  # our engine stores the frozen copy in the compute dtype
    (("engine.mixed_precision=bf16", "engine.backend=torch"), 4),  # FSDP2 keeps model.dtype, casts at the gather
])
def test_plan_counts_the_frozen_copy_in_every_phase(overrides: tuple[str, ...], itemsize: int) -> None:
    plans = [make_plan(str(REPO / "recipes" / "tiny-grpo-cpu.yaml"), [*TINY, f"grpo.beta={beta}", *overrides])
             for beta in (0, 0.5)]
    without, with_copy = (p.estimate for p in plans)
    assert plans[1].setup.world == 2 and with_copy.trainable_params == 758_912
    shard = with_copy.trainable_params * itemsize // 2
    assert with_copy.breakdown.keys() - without.breakdown.keys() == {"logps"}  # the reference's forward
    for phase, cats in with_copy.breakdown.items():
        assert cats["params"] - without.breakdown.get(phase, without.breakdown["generate"])["params"] == shard, phase
    lora = make_plan(str(REPO / "recipes" / "tiny-grpo-cpu.yaml"),
                     [*TINY, "grpo.beta=0.5", "lora.enabled=true", *overrides]).estimate
    lora_off = make_plan(str(REPO / "recipes" / "tiny-grpo-cpu.yaml"),
                         [*TINY, "grpo.beta=0", "lora.enabled=true", *overrides]).estimate
    assert all(lora.breakdown[k]["params"] == lora_off.breakdown[k]["params"] for k in lora_off.breakdown)  # no copy


def test_full_finetuning_kl_step_agrees_with_the_plan() -> None:
    """The simulated GRPO step with the copy built (at the step's start) and its reference forward: peak and
    rollout peak within 5 % of the plan (measured 0.9998 and 1.0005)."""
    out = forked_cli("plan", "recipes/tiny-grpo-cpu.yaml", *TINY, "grpo.beta=0.5", "--simulate", "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["world_size"] == 2
    assert abs(sim["simulated_peak_bytes"] / sim["analytic_peak_bytes"] - 1) <= 0.05, sim
    # the rollout holds the copy's shard (fp32: 1,517,824 bytes) on top of sampling's cache and the policy's states
    assert sim["simulated_rollout_peak_bytes"] > 1_517_824, sim
    assert abs(sim["simulated_rollout_peak_bytes"] / sim["analytic_rollout_peak_bytes"] - 1) <= 0.05, sim
