"""One resolved configuration (trainer/resolve.py): the engine's own defaults are the schema's, and plan derives
its setup from the policy train runs with."""
from __future__ import annotations

import dataclasses

import pytest

from shardtune.config.load import load_recipe
from shardtune.config.schema import Recipe
from shardtune.engine.api import BackwardSchedule, ShardingPolicy
from shardtune.plan.estimate import Setup
from shardtune.trainer.resolve import resolve_engine

# Filled by resolve_engine from something other than engine.* defaults: the model (wrap), LoRA, or the world.
NOT_ENGINE_DEFAULTS = {"unit_classes", "min_unit_params", "no_weight_decay", "replicated", "hybrid_shard_size"}


@pytest.mark.parametrize("accelerator", [False, True])
def test_engine_defaults_are_the_schema_defaults(accelerator):
    resolved, engine = resolve_engine(Recipe(), world_size=4, local_world_size=4, accelerator=accelerator), ShardingPolicy()
    for f in dataclasses.fields(ShardingPolicy):
        if f.name in NOT_ENGINE_DEFAULTS:
            continue
        mine = getattr(engine, f.name)
        if isinstance(mine, BackwardSchedule):
            mine = mine.on(accelerator=accelerator)
        assert getattr(resolved, f.name) == mine, f.name


@pytest.mark.parametrize(("overrides", "world", "nodes", "cpu"), [
    ([], 2, 1, True),
    (["engine.strategy=hybrid_shard", "engine.cpu_offload=true", "engine.mixed_precision=bf16"], 16, 2, False),
    (["lora.enabled=true", "lora.quantize_base=nf4", "engine.backward_schedule=staggered"], 4, 1, False),
    (["lora.enabled=true", "engine.backend=torch", "engine.shard_adapter_states=false"], 8, 1, False),
])
def test_plan_setup_is_the_resolved_policy(overrides, world, nodes, cpu):
    recipe = load_recipe("tiny-cpu", overrides)
    policy = resolve_engine(recipe, world_size=world, local_world_size=world // nodes, accelerator=not cpu)
    setup = Setup.from_recipe(recipe, world=world, nodes=nodes, device_is_cpu=cpu)
    ours = recipe.engine.backend == "shardtune"
    assert (setup.strategy, setup.hybrid_shard_size, setup.offload, setup.prefetch) == (
        policy.strategy.value, policy.hybrid_shard_size, policy.cpu_offload, policy.prefetch)
    assert (setup.compute, setup.reduce) == (policy.mixed_precision.param_dtype, policy.mixed_precision.reduce_dtype)
    assert setup.backward_schedule == policy.backward_schedule.value != "auto"
    assert (setup.nf4, setup.nf4_tile_bytes) == (policy.quantize_base, policy.nf4_tile_bytes)
    assert (setup.vocab_parallel, setup.split_tables) == (policy.vocab_parallel and ours, policy.vocab_parallel and not ours)
    assert setup.shard_adapter_states == (policy.shard_replicated_states and ours)
