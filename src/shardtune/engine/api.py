"""Engine policy and the handle both backends return. Torch types only: no OmegaConf, no strings like "bf16".

The trainer talks to a sharded model only through `ShardedModel`; `engine.backend` picks who implements it
(`shard.py` for ours, `torch_backend.py` for PyTorch FSDP2).

Gradient contract (both backends): gradients are SUMMED over data-parallel ranks, never averaged. The trainer
divides each micro-batch loss by the number of target tokens in the whole global batch, so the summed gradient is
exactly the single-device gradient of the global mean loss, whatever the world size and accumulation.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class ShardingStrategy(enum.Enum):
    FULL_SHARD = "full_shard"  # ZeRO-3: params, grads, optimizer state sharded; params freed after forward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: params stay gathered from forward until backward
    NO_SHARD = "no_shard"  # DDP-like: everything replicated, grads all-reduced
    HYBRID_SHARD = "hybrid_shard"  # full_shard inside groups of hybrid_shard_size, replicate across groups


class BackwardSchedule(enum.Enum):
    """When the backward gathers the previous unit ahead and waits for the next unit's reduction (engine/unit.py)."""

    OVERLAP = "overlap"  # FSDP2's: gather at pre-backward, the oldest reduction waited at the next post-backward
    STAGGERED = "staggered"  # the reduction over the first half of a unit, then the gather: one unit less memory
    AUTO = "auto"  # overlap on an accelerator, staggered on the host (`on`)

    def on(self, *, accelerator: bool) -> BackwardSchedule:
        """AUTO made concrete: overlap on an accelerator (communication hides under compute, the faster one),
        staggered on the host (gloo's collectives overlap little there; one unit less backward peak)."""
        if self is not BackwardSchedule.AUTO:
            return self
        return BackwardSchedule.OVERLAP if accelerator else BackwardSchedule.STAGGERED


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32  # compute and all-gather dtype (master weights stay fp32)
    reduce_dtype: torch.dtype = torch.float32  # dtype of gradient reduce-scatter / all-reduce


def default_no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Norm weights and biases (every parameter with fewer than 2 dims) get no weight decay."""
    return param.ndim < 2


@dataclass(frozen=True, kw_only=True)
class ShardingPolicy:
    """Defaults are the recipe schema's (config/schema.py EngineConfig); trainer/resolve.py makes a recipe into a
    policy, and tests/unit/test_resolve.py holds the two equal."""

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    unit_classes: tuple[type[nn.Module], ...] = ()  # each instance becomes one unit; () -> use min_unit_params
    min_unit_params: int | None = None  # size-based auto-wrap when unit_classes is empty
    mixed_precision: MixedPrecision = MixedPrecision()
    cpu_offload: bool = False  # sharded params, grads and optimizer state on the host
    prefetch: bool = True  # overlap the next unit's all-gather with the current unit's compute
    backward_schedule: BackwardSchedule = BackwardSchedule.AUTO
    sync_every_microstep: bool = True  # reduce-scatter every micro-step (False: only when sync is re-enabled)
    hybrid_shard_size: int | None = None  # ranks per shard group under HYBRID_SHARD
    no_weight_decay: Callable[[str, nn.Parameter], bool] = default_no_weight_decay
    # Trainable parameters kept whole on every rank, outside the flat buffers (LoRA adapters): fp32, gradients
    # summed over ranks in one bucketed collective per step (engine/replicated.py). None: none.
    replicated: Callable[[str, nn.Parameter], bool] | None = None
    # QLoRA: the frozen 2-D weights of nn.Linear modules inside the units (not the root: embeddings, norm, head) are
    # stored, sharded and all-gathered as NF4 bytes (engine/quantized.py) and dequantized to param_dtype per matmul.
    quantize_base: bool = False
    # QLoRA: bytes of the dequantized row tile an NF4 matmul computes with (engine/nf4_linear.py); 0: torchao's
    # whole-weight linear_nf4.
    nf4_tile_bytes: int = 0
    # Our backend: the embedding and head tables sharded by vocabulary rows over the shard group and never gathered
    # (engine/vocab.py). FSDP2: the (untied) embedding and head become units of their own. Applied only with a shard
    # group of more than one rank (`splits_vocab`).
    vocab_parallel: bool = True
    # Replicated params: each rank holds the gradient and AdamW state of its own contiguous run of them only
    # (engine/replicated.py: reduce-scatter, step, all-gather after the optimizer step). False: all of them.
    shard_replicated_states: bool = True
    # The inputs activation checkpointing keeps live in pinned host memory between a unit's forward and its recompute
    # (engine/offload_activations.py; applied with checkpointing, before sharding, by either backend).
    offload_activations: bool = False
    # Each unit's `mlp` runs over chunks of this many tokens (model/tiled_mlp.py; a model transform before checkpointing,
    # either backend). 0: off.
    mlp_chunk_tokens: int = 0


def splits_vocab(vocab_parallel: bool, *, shard_size: int) -> bool:
    """Whether `engine.vocab_parallel` applies to a shard group of `shard_size` ranks: with one copy per rank
    (world 1, no_shard) there is nothing to split. Both backends and `plan` ask this."""
    return vocab_parallel and shard_size > 1


class ShardedModel(Protocol):
    """What the trainer needs from a sharded model, whatever the backend."""

    module: nn.Module  # the original module, now sharded; call it as usual (forward, generate)

    def optimizer_param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW param groups over the tensors this rank steps (its shards), decay and no-decay separate."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (before clipping); clips in place when max_norm > 0."""

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: keep gradients local (unsharded) across micro-steps; True: reduce on this backward."""

    def set_requires_all_reduce(self, requires: bool) -> None:
        """Replicated gradients (LoRA adapters on our backend): False keeps them summed locally in one bucket even
        on a synced backward; the trainer sets True on a step's last micro-step only, so they cross the wire once
        per step and no reduced copy is held between micro-steps (FSDP2's name for the same switch under HSDP)."""

    def comm_bytes(self) -> int:
        """Bytes this rank sent + received in collectives since construction (monotonic)."""

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective. Yields (original name, full CPU tensor) on rank 0, unit by unit; other ranks yield nothing.
        Names are the original module's parameter names (as in named_parameters()), trainable and frozen."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer, *, for_load: bool = False) -> dict[str, Any]:
        """This rank's part of a resumable checkpoint (model + optimizer), as a dict `torch.distributed.checkpoint`
        saves and loads in place. Keys follow the original parameter names. `for_load`: the dict to load into
        (replicas may describe their chunks differently than for a save)."""

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Finish a load after `dcp.load(state)` filled the dict returned by `checkpoint_state`."""
