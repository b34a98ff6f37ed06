"""The recipe made into the engine's policy, in one place: `train` (trainer/parallelize.py), `plan` (plan/estimate.py
Setup.from_recipe), `plan --simulate` and the tests all call `resolve_engine`. Strings become torch types here;
the engine below never sees the recipe. What needs the model (the wrap classes) is added by trainer/parallelize.py."""
from __future__ import annotations

from shardtune.config.dtypes import DTYPES
from shardtune.config.schema import Recipe, check_world
from shardtune.engine.api import BackwardSchedule, MixedPrecision, ShardingPolicy, ShardingStrategy
from shardtune.model.lora import is_adapter


def resolve_engine(recipe: Recipe, *, world_size: int, local_world_size: int, accelerator: bool) -> ShardingPolicy:
    """The policy this recipe runs with on `world_size` ranks, `local_world_size` of them per node, on an
    accelerator or on the host. Unit classes are left empty (trainer/parallelize.py resolves engine.wrap on the model)."""
    engine, lora = recipe.engine, recipe.lora
    check_world(recipe, world_size, local_world_size)
    nf4 = lora.enabled and lora.quantize_base == "nf4"
    wrap = engine.wrap
    return ShardingPolicy(
        strategy=ShardingStrategy(engine.strategy),
        min_unit_params=wrap if isinstance(wrap, int) and not isinstance(wrap, bool) else None,
        mixed_precision=MixedPrecision(param_dtype=DTYPES[engine.mixed_precision],
                                       reduce_dtype=DTYPES[engine.reduce_dtype]),
        cpu_offload=engine.cpu_offload,
        prefetch=engine.prefetch or engine.backend == "torch",  # FSDP2 always gathers a unit ahead in backward
        backward_schedule=BackwardSchedule(engine.backward_schedule).on(accelerator=accelerator),
        sync_every_microstep=engine.sync_every_microstep,
        # hybrid_shard without a size shards inside one node (the ranks joined by the fast intra-node links) and
        # replicates across nodes.
        hybrid_shard_size=engine.hybrid_shard_size or (local_world_size if engine.strategy == "hybrid_shard" else None),
        # Under LoRA every trainable parameter is an adapter (peft froze the rest): kept whole on each rank.
        replicated=(lambda name, p: is_adapter(name)) if lora.enabled else None,
        quantize_base=nf4,
        # Our backend's tiled NF4 matmul (FSDP2 takes torchao's whole-weight one).
        nf4_tile_bytes=int(engine.nf4_tile_mb * (1 << 20)) if nf4 and engine.backend == "shardtune" else 0,
        vocab_parallel=engine.vocab_parallel,  # applied only with a shard group of 2+ ranks (splits_vocab)
        shard_replicated_states=engine.shard_adapter_states,
        offload_activations=engine.offload_activations,
        mlp_chunk_tokens=engine.mlp_chunk_tokens,
    )
