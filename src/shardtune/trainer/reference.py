"""GRPO's KL reference under full fine-tuning: a frozen, sharded copy of the run's starting weights.

Under LoRA the reference is the base with the adapters off (trainer/objective.py `adapters_disabled`): no second
model. Full fine-tuning moves every weight, so the reference is a second model, built
- from the recipe's model source, never from the policy: model.path's files, or model.init=random's per-module seeded
  draw (model/seeded_init.py: the same values at any world size). A resumed run's reference is therefore the fresh
  run's (the run's starting weights, not the checkpoint's);
- through the policy's own path (build_model, then parallelize: our engine or FSDP2, the same units, strategy and
  offload), every parameter frozen before it is sharded: each rank holds 1/N of it, with no gradient and no
  optimizer state. Activation checkpointing and compile are off for it: it only ever runs under no_grad.

Cost: its shard for the whole run (params / N, in the compute dtype on our engine under mixed precision, as a LoRA
run's frozen base; FSDP2 keeps model.dtype and casts at the all-gather), and one no_grad forward per micro-step of
each generation round, gathering its units one at a time as the policy's forward does (freed after it: FSDP2's root
and head, which keep their gathered buffers for a backward, are resharded explicitly).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from shardtune.config import Recipe
from shardtune.engine.api import ShardedModel


def needs_frozen_copy(recipe: Recipe) -> bool:
    """GRPO with a KL term and no adapters to switch off: the reference is a frozen copy (plan counts it too)."""
    return recipe.train.objective == "grpo" and recipe.grpo.beta > 0 and not recipe.lora.enabled


class FrozenCopy:
    """The frozen sharded reference; `logps(fn, ids)` runs `fn(module, ids)` on it under no_grad."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded
        self.module: nn.Module = sharded.module
        self.module.eval()  # no dropout: the reference is a fixed distribution

    @classmethod
    def build(cls, recipe: Recipe, *, device: torch.device, world_size: int) -> FrozenCopy:
        """Collective (every rank): the recipe's starting model, frozen and sharded like the policy."""
        from shardtune.model.build import build_model
        from shardtune.trainer.parallelize import parallelize

        engine = dataclasses.replace(recipe.engine, activation_checkpointing=False, offload_activations=False,
                                     compile=False)
        model = build_model(recipe.model, seed=recipe.train.seed, device=device, sharded_init=True)
        model.requires_grad_(False)  # before sharding: the engine gives frozen flats no gradient and no optimizer
        if engine.mixed_precision == "bf16" and engine.backend == "shardtune":
            # used only in bf16 compute: stored in bf16 (half the bytes, no cast before the all-gather), the same
            # values the policy's first forward computes with (its fp32 masters cast at the gather)
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        return cls(parallelize(model, dataclasses.replace(recipe, engine=engine), device=device,
                               world_size=world_size))

    @torch.no_grad()
    def logps(self, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        try:
            return fn(self.module, ids)
        finally:
            for m in getattr(self.sharded, "_fsdp_modules", ()):  # FSDP2: no backward will reshard the root/head
                m.reshard()

    def state_bytes(self) -> int:
        """This rank's bytes of the copy: its shards (FSDP2: each DTensor's local part). It holds nothing else."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]
        return sum(t.numel() * t.element_size() for t in local)
