"""engine.backward_schedule in the plan: overlap (FSDP2's) holds the previous unit and the next unit's reduction
at once (one unit more backward memory than staggered) and hides more communication; `--fit` weighs both on GPUs."""
from __future__ import annotations

import dataclasses

from shardtune.plan import make_plan
from shardtune.plan.planner import variant
from shardtune.plan.search import fit_search, step_time

RECIPE = "llama-3.1-8b-full-8x80gb"


def test_auto_is_overlap_on_gpu_and_staggered_on_cpu() -> None:
    assert make_plan(RECIPE, []).setup.backward_schedule == "overlap"
    assert make_plan("tiny-cpu", []).setup.backward_schedule == "staggered"
    assert make_plan(RECIPE, ["engine.backward_schedule=staggered"]).setup.backward_schedule == "staggered"


def test_overlap_costs_about_one_unit_of_backward_memory_and_exposes_less_communication() -> None:
    p = make_plan(RECIPE, [])
    overlap, staggered = variant(p, backward_schedule="overlap"), variant(p, backward_schedule="staggered")
    one_unit_grad = max(u.trainable.padded_numel for u in p.estimate.units if u.trainable) * 4  # fp32 reduce
    diff = {k: overlap.estimate.phases[k] - staggered.estimate.phases[k] for k in overlap.estimate.phases}
    assert all(d >= 0 for d in diff.values()) and 0 < max(diff.values()) <= one_unit_grad, diff
    # Communication-bound (slow link): staggered exposes part of the backward's collectives.
    slow = dataclasses.replace(p.hardware, intra_node_gbps=p.hardware.intra_node_gbps / 50)
    t_overlap = step_time(dataclasses.replace(overlap, hardware=slow))["step_s"]
    t_staggered = step_time(dataclasses.replace(staggered, hardware=slow))["step_s"]
    assert t_staggered > t_overlap


def test_fit_search_weighs_both_schedules_on_gpus() -> None:
    found = fit_search(make_plan(RECIPE, ["train.micro_batch_size=4", "train.grad_accum=2"]))
    schedules = {c.plan.setup.backward_schedule for c in found}
    assert schedules == {"overlap", "staggered"}
    assert "engine.backward_schedule=" in found[0].overrides()
