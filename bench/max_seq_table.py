"""bench/RESULTS.md's "longest sequence that fits" table in one process (the loop over `shardtune plan --max-seq`,
before: each hardware recipe as shipped; after: with checkpointing, offloaded activations and 4,096-token chunks).

  PYTHONPATH=src python bench/max_seq_table.py
"""
from __future__ import annotations

from pathlib import Path

from shardtune.plan.hardware import GiB
from shardtune.plan.long_context import max_seq
from shardtune.plan.planner import make_plan

AFTER = ["engine.activation_checkpointing=true", "engine.offload_activations=true", "engine.mlp_chunk_tokens=4096"]


def cell(recipe: str, overrides: list[str]) -> str:
    n, plan = max_seq(make_plan(recipe, overrides))
    if plan is None:
        return "none"
    e = plan.estimate
    return f"{n:,} ({e.total / GiB:.2f}, {e.host_per_rank / GiB:.2f})"


def main() -> None:
    print("| recipe | before: tokens (device GiB, host GiB/rank) | after: tokens (device GiB, host GiB/rank) |")
    print("|---|---|---|")
    for path in sorted(Path("recipes/hardware").glob("*.yaml")):
        print(f"| {path.stem} | {cell(str(path), [])} | {cell(str(path), AFTER)} |", flush=True)


if __name__ == "__main__":
    main()
