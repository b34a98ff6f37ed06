"""Recipe -> Plan: model stats on meta, the memory estimate, the capacity check, advice. `cli.plan` prints it."""
from __future__ import annotations

from shardtune.config.load import load_recipe
from shardtune.config.schema import Recipe, check_world
from shardtune.errors import UserError
from shardtune.plan.estimate import Setup, estimate
from shardtune.plan.hardware import GiB, HardwareProfile, planned_profile
from shardtune.plan.headroom import headroom_advice
from shardtune.plan.result import Plan, quantized_summary, variant
from shardtune.plan.search import advice
from shardtune.plan.stats import ModelStats

__all__ = ["GiB", "Plan", "make_plan", "plan_recipe", "quantized_summary", "variant", "world_of"]


def world_of(recipe: Recipe) -> tuple[int, int]:
    """(world size, nodes): launch.nproc_per_node x launch.nnodes when fixed, else hardware.num_gpus."""
    nodes = recipe.launch.nnodes
    n = recipe.launch.nproc_per_node
    if isinstance(n, int):
        return n * nodes, nodes
    gpus = recipe.hardware.num_gpus
    if gpus % nodes:  # every node runs the same number of workers
        raise UserError(f"hardware.num_gpus={gpus} (the job's GPUs, all nodes together) does not split evenly over "
                        f"launch.nnodes={nodes}: set hardware.num_gpus to a multiple of {nodes}, or "
                        "launch.nproc_per_node to the GPUs per node")
    return gpus, nodes


def plan_recipe(recipe: Recipe, *, stats: ModelStats | None = None, setup: Setup | None = None,
                with_advice: bool = True, hardware: HardwareProfile | None = None) -> Plan:
    """`hardware`: a detected card (train's pre-flight) instead of the recipe's profile (plan/hardware.py
    planned_profile: `hardware.gpu`, or host memory for a CPU recipe)."""
    stats = stats or ModelStats(recipe)
    hw = hardware or planned_profile(recipe)
    if setup is None:
        world, nodes = world_of(recipe)
        setup = Setup.from_recipe(recipe, world=world, nodes=nodes,
                                  device_is_cpu=hw.is_cpu or recipe.launch.device == "cpu")
    check_world(recipe, setup.world)
    plan = Plan(recipe, stats, setup, estimate(stats, setup), hw)
    if with_advice:  # what makes it fit, or (plan/headroom.py) what gives it 3 % of room when it fits by less
        plan.advice = headroom_advice(plan) if plan.fits else advice(plan)
    return plan


def make_plan(recipe: str, overrides: list[str] | None = None) -> Plan:
    from shardtune.plan.model_limits import check_model_limits

    r = load_recipe(recipe, overrides or [])
    check_model_limits(r)  # a recipe train would refuse does not "fit"
    return plan_recipe(r)
