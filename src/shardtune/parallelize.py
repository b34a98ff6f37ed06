"""Recipe -> engine policy -> sharded model. The only place where recipe strings become torch types.

Transforms run in a fixed order, and the order matters:
  1. inject LoRA (peft replaces Linear modules, so units and frozen flags must see the final module tree),
  2. activation checkpointing (wraps whole units; the engine's hooks then see one checkpointed call per unit),
  3. shard (flattens parameters into per-unit buffers; anything after this would see views, not parameters).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

from shardtune import accelerator
from shardtune.config.schema import EngineConfig, Recipe, check_world
from shardtune.engine.api import (
    BackwardSchedule,
    MixedPrecision,
    ShardedModel,
    ShardingPolicy,
    ShardingStrategy,
)
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.wrap import resolve_unit_classes
from shardtune.errors import UserError
from shardtune.loading import load_full, load_into_shards
from shardtune.lora import apply_lora, is_adapter
from shardtune.moe_checks import moe_problems
from shardtune.seeded_init import init_full, init_into_shards

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def backward_schedule(engine: EngineConfig, device: torch.device | str) -> str:
    """`auto`: overlap on an accelerator (the faster one: communication hides under compute, FSDP2's schedule),
    staggered on the host (gloo's collectives overlap little there, and it keeps the backward peak one unit lower)."""
    if engine.backward_schedule != "auto":
        return engine.backward_schedule
    return "overlap" if accelerator.is_accelerator(torch.device(device)) else "staggered"


def sharding_policy(engine: EngineConfig, model: nn.Module, world_size: int, *, lora: bool = False,
                    quantize_base: str | None = None, device: torch.device | str = "cpu") -> ShardingPolicy:
    # hybrid_shard without a size shards inside one node (torchrun's LOCAL_WORLD_SIZE: the ranks on this node,
    # joined by the fast intra-node links) and replicates across nodes.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    check_world(engine, world_size, local_world_size)
    wrap = engine.wrap
    wrap_spec = list(wrap) if not isinstance(wrap, (str, int)) else wrap
    return ShardingPolicy(
        strategy=ShardingStrategy(engine.strategy),
        unit_classes=resolve_unit_classes(model, wrap_spec),
        min_unit_params=wrap_spec if isinstance(wrap_spec, int) else None,
        mixed_precision=MixedPrecision(param_dtype=DTYPES[engine.mixed_precision],
                                       reduce_dtype=DTYPES[engine.reduce_dtype]),
        cpu_offload=engine.cpu_offload,
        prefetch=engine.prefetch,
        backward_schedule=BackwardSchedule(backward_schedule(engine, device)),
        sync_every_microstep=engine.sync_every_microstep,
        hybrid_shard_size=engine.hybrid_shard_size or (local_world_size if engine.strategy == "hybrid_shard" else None),
        # Under LoRA every trainable parameter is an adapter (peft froze the rest): keep them whole on each rank.
        replicated=(lambda name, p: is_adapter(name)) if lora else None,
        quantize_base=quantize_base == "nf4",
        nf4_tile_bytes=int(engine.nf4_tile_mb * (1 << 20)) if quantize_base == "nf4" else 0,
        vocab_parallel=engine.vocab_parallel,  # each backend applies it only with a shard group of 2+ ranks
        shard_replicated_states=engine.shard_adapter_states,
    )


def parallelize(model: nn.Module, recipe: Recipe, *, device: torch.device, world_size: int) -> ShardedModel:
    engine = recipe.engine
    # 1. LoRA first: it replaces Linear modules and freezes the base, so units and frozen flags see the final tree.
    problems = moe_problems(recipe, model)
    if problems:
        raise UserError(problems[0])
    if recipe.lora.enabled:
        apply_lora(model, recipe.lora, base_name=recipe.model.path or recipe.model.config, seed=recipe.train.seed)
        materialize_adapters(model, seed=recipe.train.seed)  # pretrained base on meta: peft put adapters there too
        if engine.mixed_precision == "bf16" and engine.backend == "shardtune":
            # The frozen base is only ever used in bf16 compute: store its shards in bf16 too (half the memory, no
            # cast before the all-gather). Adapters stay fp32 (the engine keeps replicated params in fp32).
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    policy = sharding_policy(engine, model, world_size, lora=recipe.lora.enabled,
                             quantize_base=recipe.lora.quantize_base if recipe.lora.enabled else None, device=device)
    if engine.cpu_offload and not accelerator.is_accelerator(device):
        warnings.warn("engine.cpu_offload=true saves no memory on a CPU run (params, grads and optimizer state are "
                      "already on the host); the offload path still runs", stacklevel=2)
    # 2. Activation checkpointing wraps whole units' forwards before sharding: the engine's hooks then sit outside
    #    the checkpointed region, and the recompute runs on the gather the backward needs anyway.
    ac = engine.activation_checkpointing
    if ac is not False:
        apply_activation_checkpointing(model, policy.unit_classes, every_k=1 if ac is True else int(ac),
                                       min_unit_params=policy.min_unit_params)
    # 3. Shard last: it flattens parameters into per-unit buffers (anything after would see views, not parameters).
    #    Parameters still on meta (model.init=pretrained, or a random init built with sharded_init) are filled here:
    #    our engine fills each rank's shards only (from the files, or drawn one module at a time).
    pretrained = Path(recipe.model.path) if recipe.model.init == "pretrained" else None
    random_meta = pretrained is None and any(p.is_meta for p in model.parameters())
    init_dtype = DTYPES[recipe.model.dtype]
    if engine.backend == "torch":
        from shardtune.engine import torch_backend

        if pretrained is not None:
            load_full(model, pretrained, device)  # FSDP2 path: every rank reads the whole model, then shards
        elif random_meta:
            init_full(model, seed=recipe.train.seed, dtype=init_dtype, device=device)  # whole, then sharded
        if policy.quantize_base:  # QLoRA on FSDP2: the same weights as NF4Tensor parameters (torchao's FSDP2 hooks)
            from shardtune.engine.layout import group_unit_params
            from shardtune.engine.nf4 import quantize_parameters

            quantize_parameters(model, [e for up in group_unit_params(model, policy) for e in up.quantized],
                                policy.mixed_precision.param_dtype)
        return torch_backend.shard_model(model, policy, device=device)
    from shardtune.engine import shard

    sharded = shard.shard_model(model, policy, device=device)
    if pretrained is not None:
        load_into_shards([f for u in sharded.units for f in u.flats], sharded.module, pretrained)
    elif random_meta:
        init_into_shards(sharded.units, sharded.module, seed=recipe.train.seed, dtype=init_dtype, device=device)
    return sharded


def materialize_adapters(model: nn.Module, *, seed: int) -> None:
    """LoRA adapters left on the meta device get real, seeded (identical on every rank) peft initialisation."""
    meta = [m for m in model.modules() if hasattr(m, "reset_lora_parameters")
            and any(p.is_meta for p in m.parameters(recurse=True) if p.requires_grad)]
    if not meta:
        return
    torch.manual_seed(seed)
    for m in meta:
        for adapter in m.lora_A:
            m.lora_A[adapter].to_empty(device="cpu")  # a meta tensor cannot take real data in place
            m.lora_B[adapter].to_empty(device="cpu")
            m.reset_lora_parameters(adapter, True)
