"""`shardtune plan`: predict the per-rank peak memory of a recipe before renting GPUs (see estimate.py).

The names load on first use (PEP 562): `shardtune.plan.bound` and `.hardware` are torch-free, and the launcher's
pre-flight imports them without paying for torch (planner.py needs it).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.plan.planner import Plan, make_plan, plan_recipe

__all__ = ["Plan", "make_plan", "plan_recipe"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'shardtune.plan' has no attribute {name!r}")
    return getattr(importlib.import_module("shardtune.plan.planner"), name)
