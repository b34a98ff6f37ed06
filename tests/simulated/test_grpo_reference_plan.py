"""GRPO with grpo.beta > 0 under full fine-tuning: the frozen reference copy (trainer/reference.py) in the plan
(plan/grpo.py frozen_copy_bytes) and on the simulated GPU, and its build stays out of the measured step (setup).

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


def test_offloaded_copy_is_planned_on_the_host() -> None:
    """engine.cpu_offload: the copy's shards sit on the host beside the policy's (the device gathers them per unit,
    as the policy's): the plan's host grows by the shard, its device params do not."""
    plans = [make_plan(str(REPO / "recipes" / "tiny-grpo-cpu.yaml"),
                       [*TINY, "engine.cpu_offload=true", f"grpo.beta={beta}"]).estimate for beta in (0, 0.5)]
    assert plans[1].host_per_rank - plans[0].host_per_rank == 758_912 * 4 // 2
    assert all(plans[1].breakdown[k]["params"] == plans[0].breakdown[k]["params"] for k in plans[0].breakdown)


@pytest.mark.parametrize("offload", [False, True])
def test_full_finetuning_kl_step_agrees_with_the_plan(offload: bool) -> None:
    """The simulated GRPO step with the copy (built in setup) and its reference forward: peak and rollout peak
    within 5 % of the plan (measured 0.9998 and 1.0005; offloaded 0.9997 and 1.021, the host 1.00001)."""
    out = forked_cli("plan", "recipes/tiny-grpo-cpu.yaml", *TINY, "grpo.beta=0.5", f"engine.cpu_offload={offload}",
                     "--simulate", "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["world_size"] == 2
    # built in setup: no build (sharding, the ranks' fingerprint check) inside the measured step
    assert not [x for x in sim["host_syncs"] if "shard_model" in x or "fingerprint" in x], sim["host_syncs"]
    assert abs(sim["simulated_peak_bytes"] / sim["analytic_peak_bytes"] - 1) <= 0.05, sim
    assert abs(sim["simulated_rollout_peak_bytes"] / sim["analytic_rollout_peak_bytes"] - 1) <= 0.05, sim
    if offload:  # the policy's states and the copy's shard (fp32: 1,517,824 bytes) on the host
        assert abs(sim["simulated_host_bytes"] / sim["analytic_host_bytes"] - 1) <= 0.01, sim
    else:  # the rollout holds the copy's shard on top of sampling's cache and the policy's states
        assert sim["simulated_rollout_peak_bytes"] > 1_517_824, sim
