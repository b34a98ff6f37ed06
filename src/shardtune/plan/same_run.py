"""When two `--fit` candidates are one run: knobs that change nothing at a candidate's size, and the strategies of a
single rank. `plan --fit` lists each run once, under the recipe's own value of every knob that changes nothing."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shardtune.engine.api import splits_vocab

if TYPE_CHECKING:
    from shardtune.plan.candidate import Candidate
    from shardtune.plan.estimate import Setup


def canonical(setup: Setup, recipe: Setup) -> Setup:
    """`setup` with each knob that changes nothing in it set to the recipe's value:
    - engine.nf4_tile_mb without an NF4 base: nothing is dequantized;
    - engine.vocab_parallel with a shard group of one rank: nothing to split (engine/api.py splits_vocab);
    - engine.shard_adapter_states without LoRA or on one rank: one copy of the adapter states either way;
    - engine.backward_schedule on one rank: no reduction to order (engine/collectives.py moves nothing);
    - hybrid_shard whose one shard group is the world: engine/shard.py builds full_shard's groups."""
    changes: dict = {}
    if not (setup.lora and setup.nf4):
        changes["nf4_tile_bytes"] = recipe.nf4_tile_bytes
    if not splits_vocab(True, shard_size=setup.shard_size):
        changes["vocab_parallel"] = recipe.vocab_parallel
    if not setup.lora or setup.world == 1:
        changes["shard_adapter_states"] = recipe.shard_adapter_states
    if setup.world == 1:
        changes["backward_schedule"] = recipe.backward_schedule
    one_group = ("full_shard", "hybrid_shard")
    if setup.strategy in one_group and dataclasses.replace(setup, strategy="hybrid_shard").shard_size == setup.world:
        changes["strategy"] = recipe.strategy if recipe.strategy in one_group else "full_shard"
    return dataclasses.replace(setup, **changes)


def distinct(found: list[Candidate]) -> list[Candidate]:
    """`found` (best first) less the later of two candidates that are one run: the same overrides, on one rank
    strategies the plan cannot tell apart, or backward schedules it cannot tell apart. One rank builds no process group under any strategy (engine/shard.py
    build_groups); the strategies differ only in keeping a unit's gathered copy from forward to backward, which is
    no copy when the unit computes on its shard itself (no cast, no offload): then every phase and the step time
    are equal, and the first (the recipe's strategy, by fit_search's order) stands for all."""
    seen: set = set()
    out = []
    for c in found:
        s = c.plan.setup
        predicted = (tuple(sorted(c.plan.estimate.phases.items())), c.time["step_s"])
        key = (dataclasses.replace(s, strategy=""), *predicted) if s.world == 1 else s
        # Backward schedules the plan cannot tell apart (the same peak in every phase and the same step time: no
        # reduction for staggering to hold back, e.g. no_shard or a frozen base): one row, the first (the recipe's
        # schedule, by fit_search's order). A user could not choose between two rows that predict the same.
        schedule_key = (dataclasses.replace(s, backward_schedule=""), *predicted)
        if key in seen or schedule_key in seen or c.overrides() in seen:
            continue
        seen.update((key, schedule_key, c.overrides()))
        out.append(c)
    return out
