"""`shardtune plan`: predict the per-rank peak memory of a recipe before renting GPUs (see estimate.py)."""
from shardtune.plan.planner import Plan, make_plan, plan_recipe

__all__ = ["Plan", "make_plan", "plan_recipe"]
