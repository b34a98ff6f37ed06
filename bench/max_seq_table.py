"""bench/RESULTS.md's "longest sequence that fits" table in one process (the loop over `shardtune plan --max-seq`,
before: each hardware recipe as shipped; after: with checkpointing, offloaded activations and 4,096-token chunks;
then the same with engine.context_parallel where the recipe's shard group has 2+ ranks and allows it).

  PYTHONPATH=src python bench/max_seq_table.py
"""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError
from shardtune.plan.hardware import GiB
from shardtune.plan.long_context import max_seq
from shardtune.plan.planner import make_plan

AFTER = ["engine.activation_checkpointing=true", "engine.offload_activations=true", "engine.mlp_chunk_tokens=4096"]


def cell(recipe: str, overrides: list[str]) -> str:
    try:
        start = make_plan(recipe, overrides)
    except UserError as e:
        return f"refused ({str(e).split(':')[0]})"
    if "engine.context_parallel=true" in overrides and start.setup.context_parallel == 1:
        return "n/a (shard group of one)"
    n, plan = max_seq(start)
    if plan is None:
        return "none"
    e = plan.estimate
    return f"{n:,} ({e.total / GiB:.2f}, {e.host_per_rank / GiB:.2f})"


def main() -> None:
    print("| recipe | before: tokens (device GiB, host GiB/rank) | after: tokens (device GiB, host GiB/rank) | "
          "after + context parallel |")
    print("|---|---|---|---|")
    for path in sorted(Path("recipes/hardware").glob("*.yaml")):
        print(f"| {path.stem} | {cell(str(path), [])} | {cell(str(path), AFTER)} | "
              f"{cell(str(path), [*AFTER, 'engine.context_parallel=true'])} |", flush=True)


if __name__ == "__main__":
    main()
