"""Recipe -> engine policy -> sharded model. The only place where recipe strings become torch types.

Transforms run in a fixed order, and the order matters:
  1. inject LoRA (peft replaces Linear modules, so units and frozen flags must see the final module tree),
  2. the MLPs, norms and adapter branches chunked over the sequence (engine.mlp_chunk_tokens: forward swaps
     inside each unit, so they sit inside the unit's checkpoint and its recompute),
     then activation checkpointing (wraps whole units; the engine's hooks then see one checkpointed call per unit),
  3. shard (flattens parameters into per-unit buffers; anything after this would see views, not parameters).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

import torch
from torch import nn

from shardtune import accelerator
from shardtune.config.dtypes import DTYPES
from shardtune.config.schema import Recipe
from shardtune.engine.api import ShardedModel, ShardingPolicy
from shardtune.engine.checkpointing import apply_activation_checkpointing, engine_recomputes
from shardtune.engine.collectives import GatherSequence
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units, resolve_unit_classes
from shardtune.errors import UserError
from shardtune.hub import WEIGHTS, model_dir
from shardtune.model import context_parallel
from shardtune.model.build import config_source
from shardtune.model.loading import CheckpointFiles, check_checkpoint_shapes, load_into_shards
from shardtune.model.lora import apply_lora
from shardtune.model.moe_checks import moe_problems
from shardtune.model.seeded_init import init_into_shards
from shardtune.model.tiled_mlp import apply_sequence_chunking
from shardtune.trainer.resolve import resolve_engine


def sharding_policy(recipe: Recipe, model: nn.Module, *, world_size: int,
                    device: torch.device | str = "cpu") -> ShardingPolicy:
    """The recipe's policy (trainer/resolve.py) with engine.wrap resolved on this model. torchrun's LOCAL_WORLD_SIZE
    is the ranks on this node (hybrid_shard's default shard group)."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    policy = resolve_engine(recipe, world_size=world_size, local_world_size=local_world_size,
                            accelerator=accelerator.is_accelerator(torch.device(device)))
    wrap = recipe.engine.wrap
    return dataclasses.replace(policy, unit_classes=resolve_unit_classes(
        model, list(wrap) if not isinstance(wrap, (str, int)) else wrap))


def parallelize(model: nn.Module, recipe: Recipe, *, device: torch.device, world_size: int) -> ShardedModel:
    engine = recipe.engine
    # 1. LoRA first: it replaces Linear modules and freezes the base, so units and frozen flags see the final tree.
    context_parallel.disable()  # set again below when the recipe asks (a process may build several models)
    problems = moe_problems(recipe, model)
    if problems:
        raise UserError(problems[0])
    if recipe.lora.enabled:
        # the adapter's base: the model folder or hub id it was trained over (a random init has none on any disk)
        base_name = recipe.model.path if recipe.model.init == "pretrained" else None
        apply_lora(model, recipe.lora, base_name=base_name, seed=recipe.train.seed)
        materialize_adapters(model, seed=recipe.train.seed)  # pretrained base on meta: peft put adapters there too
        if engine.mixed_precision == "bf16" and engine.backend == "shardtune":
            # The frozen base is only ever used in bf16 compute: store its shards in bf16 too (half the memory, no
            # cast before the all-gather). Adapters stay fp32 (the engine keeps replicated params in fp32).
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    policy = sharding_policy(recipe, model, world_size=world_size, device=device)
    if engine.cpu_offload and not accelerator.is_accelerator(device):
        warnings.warn("engine.cpu_offload=true saves no memory on a CPU run (params, grads and optimizer state are "
                      "already on the host); the offload path still runs", stacklevel=2)
    # 2. The MLPs chunked over the sequence inside each unit (their chunks checkpointed), then activation
    #    checkpointing wraps whole units' forwards before sharding: the engine's hooks then sit outside
    #    the checkpointed region, and the recompute runs on the gather the backward needs anyway.
    if policy.mlp_chunk_tokens:
        apply_sequence_chunking(find_units(model, policy.unit_classes, policy.min_unit_params),
                                chunk_tokens=policy.mlp_chunk_tokens)
    if engine.compile and engine.backend == "shardtune":
        # Compiled before checkpointing wraps the same forward: the order, from the outside in, is the engine's
        # hooks (gather, free) -> the checkpoint -> the compiled block, so neither the hooks nor the recompute's
        # bookkeeping is traced, and the recompute calls the same compiled graph again.
        from shardtune.engine.compile import compile_units

        compile_units(model, policy.unit_classes, policy.min_unit_params, packed=recipe.data.packing)
    ac = engine.activation_checkpointing
    if ac is not False:
        offloader = ActivationOffloader(device) if policy.offload_activations else None
        recompute = engine_recomputes(backend=engine.backend, compile=engine.compile, nf4=bool(policy.quantize_base))
        apply_activation_checkpointing(model, policy.unit_classes, every_k=1 if ac is True else int(ac),
                                       min_unit_params=policy.min_unit_params, offloader=offloader,
                                       recompute=recompute)
    # 3. Shard last: it flattens parameters into per-unit buffers (anything after would see views, not parameters).
    #    Parameters still on meta (model.init=pretrained, or a random init built with sharded_init) are filled here:
    #    our engine fills each rank's shards only (from the files, or drawn one module at a time).
    pretrained = model_dir(recipe.model.path, WEIGHTS) if recipe.model.init == "pretrained" else None
    if pretrained is not None:
        check_checkpoint_shapes(model, pretrained, config_source(recipe.model))
    random_meta = pretrained is None and any(p.is_meta for p in model.parameters())
    init_dtype = DTYPES[recipe.model.dtype]
    if engine.backend == "torch":
        from shardtune.engine import torch_backend

        if engine.compile:
            warnings.warn("engine.compile=true is ignored with engine.backend=torch: only our engine compiles its "
                          "decoder blocks; set engine.backend=shardtune to compile them", stacklevel=2)
        if not engine.prefetch:
            warnings.warn("engine.prefetch=false is ignored with engine.backend=torch: FSDP2 always gathers the next "
                          "unit ahead in backward (shardtune plan counts it)", stacklevel=2)
        if engine.cpu_offload and recipe.train.grad_accum > 1 and engine.sync_every_microstep:
            # torch 2.13 foreach_reduce: a gradient already on the host is added to by a blocking D2H copy
            warnings.warn("engine.backend=torch with engine.cpu_offload=true and train.grad_accum > 1: FSDP2 copies "
                          "each micro-step's gradient to the host blocking (a host sync per parameter); set "
                          "engine.sync_every_microstep=false to reduce once per step (LoRA: the adapters' "
                          "unsharded gradients stay on the GPU meanwhile)", stacklevel=2)

        simulated = accelerator.is_simulated(device)
        # fully_shard on meta, then each rank makes only its own chunks (engine/fsdp2_init.py); the simulated GPU's
        # chunks are meta already, or, under offload, host buffers of their size. QLoRA: torchao quantizes whole
        # weights before fully_shard, so each unit's quantized weights are made just before FSDP2 shards it, one
        # weight at a time (plan/estimate.py fsdp2_load_phase counts one unit whole).
        from shardtune.engine import fsdp2_init

        make = None
        with CheckpointFiles(pretrained) if pretrained is not None and policy.quantize_base else \
                contextlib.nullcontext() as ckpt:
            if policy.quantize_base:
                from shardtune.engine.layout import group_unit_params

                make = fsdp2_init.quantized_weights_maker(
                    model, [e for up in group_unit_params(model, policy) for e in up.quantized], device=device,
                    ckpt=ckpt, seed=recipe.train.seed, dtype=init_dtype, compute=policy.mixed_precision.param_dtype)
            sharded = torch_backend.shard_model(model, policy, device=device, before_shard=make)
        if simulated:
            if policy.cpu_offload:
                from shardtune.simulated.fsdp2_offload import offload_shards

                offload_shards(sharded._fsdp_modules)
        elif pretrained is not None or random_meta:
            fsdp2_init.fill_local_shards(model, device=device, host=policy.cpu_offload, pretrained=pretrained,
                                         seed=recipe.train.seed, dtype=init_dtype)
        return sharded
    from shardtune.engine import shard

    sharded = shard.shard_model(model, policy, device=device)
    enable_context_parallel(sharded, on=engine.context_parallel)
    if pretrained is not None:
        load_into_shards([f for u in sharded.units for f in u.flats], sharded.module, pretrained)
    elif random_meta:
        init_into_shards(sharded.units, sharded.module, seed=recipe.train.seed, dtype=init_dtype, device=device)
    return sharded


def enable_context_parallel(sharded: Any, *, on: bool) -> None:
    """engine.context_parallel: sequences split over the engine's shard group (model/context_parallel.py)."""
    group = sharded.ctx.shard_group if on else None
    context_parallel.enable(group, lambda t: GatherSequence.apply(t, group, sharded.ctx.counter,
                                                                  sharded.ctx.reduce_dtype))


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
