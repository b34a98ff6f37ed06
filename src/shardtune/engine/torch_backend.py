"""engine.backend=torch: PyTorch FSDP2 `fully_shard` with the same policy (units, strategy, precision, offload).

It is the A/B reference for our engine, so it follows the same contract as `shard.py` (see api.py): gradients
summed over ranks, AdamW groups split by `no_weight_decay`, full state dict streamed to rank 0.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from shardtune import accelerator
from shardtune.engine.api import ShardingPolicy, ShardingStrategy, splits_vocab
from shardtune.engine.clip import scale_grads_, sq_norm
from shardtune.engine.wrap import find_units


def build_mesh(device_type: str, strategy: ShardingStrategy, hybrid_shard_size: int | None) -> DeviceMesh:
    """1-D mesh for full_shard/shard_grad_op; 2-D (replicate, shard) for hybrid_shard and no_shard."""
    world = dist.get_world_size()
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    shard = 1 if strategy is ShardingStrategy.NO_SHARD else (hybrid_shard_size or world)
    assert world % shard == 0, "validated before sharding"
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective over its mesh), gathered on the mesh's device: under cpu_offload
    FSDP2's shards are host DTensors, and NCCL takes no host tensor (a copy of this shard to the device first)."""
    if not isinstance(p, DTensor):
        return p
    device = torch.device(p.device_mesh.device_type)
    if p.to_local().device.type != device.type:
        p = p.to(device)
    return p.full_tensor()


class TorchShardedModel:
    def __init__(self, module: nn.Module, policy: ShardingPolicy, mesh: DeviceMesh, device: torch.device) -> None:
        self.module = module
        self.policy = policy
        self.mesh = mesh
        self.device = device
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]

    def optimizer_param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                (no_decay if self.policy.no_weight_decay(name, p) else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The squared norm of each rank's local shards, summed over the shard mesh dim on the device (replicas
        hold the same shards). Not DTensor's own reduction: under cpu_offload it would all-reduce a host tensor on
        the device group."""
        local = [g.to_local() if isinstance(g, DTensor) else g for g in
                 (p.grad for p in self.module.parameters()) if g is not None]
        sq = sq_norm(local, self.device)
        if self.mesh.size(self.mesh.mesh_dim_names.index("shard")) > 1:
            dist.all_reduce(sq, group=self.mesh.get_group("shard"))
        total = sq.sqrt()
        scale_grads_(local, total, max_norm)
        return total

    def set_requires_gradient_sync(self, sync: bool) -> None:
        for m in self._fsdp_modules:
            m.set_requires_gradient_sync(sync, recurse=False)

    def set_requires_all_reduce(self, requires: bool) -> None:
        """Nothing to do: FSDP2 shards the adapters like every parameter (no replicated bucket). Its own switch of
        this name (HSDP's replica all-reduce) stays on: hybrid grads are reduced as sync_every_microstep says."""

    def comm_bytes(self) -> int:
        return -1  # FSDP2 exposes no byte counter; the benchmark compares ours against theory instead

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        rank0 = dist.get_rank() == 0
        for name, p in self.module.named_parameters():
            full = full_tensor(p.detach())  # collective per parameter
            if rank0:
                yield name, accelerator.to_host(full.detach(), copy=True)
            del full

    def checkpoint_state(self, optimizer: torch.optim.Optimizer, *, for_load: bool = False) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from shardtune.engine.state_dict import init_optimizer_state

        init_optimizer_state(optimizer)  # so a resume can load into existing state tensors
        model_sd, optim_sd = get_state_dict(self.module, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def shard_model(module: nn.Module, policy: ShardingPolicy, *, device: torch.device,
                before_shard: Callable[[nn.Module], None] | None = None) -> TorchShardedModel:
    """`fully_shard` per unit, the tables, then the root. `before_shard(m)`, when given, runs just before each
    module is sharded (QLoRA: its weights made and quantized then, engine/fsdp2_init.py)."""
    mesh = build_mesh(device.type, policy.strategy, policy.hybrid_shard_size)
    _states_to(module, device)
    mp = MixedPrecisionPolicy(param_dtype=policy.mixed_precision.param_dtype,
                              reduce_dtype=policy.mixed_precision.reduce_dtype)
    # pinned on a GPU and on the simulated one (simulated/fsdp2_offload.py gives it pinned host shards)
    offload = CPUOffloadPolicy(pin_memory=accelerator.is_accelerator(device)) if policy.cpu_offload else OffloadPolicy()
    reshard = policy.strategy is not ShardingStrategy.SHARD_GRAD_OP
    units = find_units(module, policy.unit_classes, policy.min_unit_params)
    # As torchtitan does: the embedding and the head are units of their own (when untied), so the root's gathered
    # buffer never holds both V x H tables. The embedding is freed after its forward (and re-gathered for its
    # backward when it trains); the head is the first unit backward needs, so it stays gathered (reshard=False).
    emb, head = (table_units(module) if splits_vocab(policy.vocab_parallel, shard_size=mesh.size(-1))
                 else (None, None))
    def shard(m: nn.Module, reshard_after_forward: bool) -> None:
        if before_shard is not None:
            before_shard(m)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)

    if emb is not None:
        shard(emb, reshard)
    for unit in units:
        shard(unit, reshard)
    if head is not None:
        shard(head, False)
    # The root is the last unit FSDP2 runs backward for; it keeps its params for backward (reshard=False).
    shard(module, False)
    sharded = TorchShardedModel(module, policy, mesh, device)
    for m in sharded._fsdp_modules:
        # Our contract: sum over ranks (the loss is already globally normalised). Forcing a plain SUM also avoids
        # PREMUL_SUM, which gloo lacks.
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return sharded


def _states_to(module: nn.Module, device: torch.device) -> None:
    """Parameters (LoRA adapters built on the host) and buffers (rotary inv_freq) moved to the device by swapping
    them, not in place as fully_shard would (`.data =`), which cannot change the tensor type: host -> meta, the
    simulated GPU."""
    for m in module.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)
        for p in m._parameters.values():  # meta ones stay: fully_shard takes them so, engine/fsdp2_init.py fills them
            if p is not None and not p.is_meta and p.device.type != device.type:
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad))


def table_units(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(embedding, head) modules to shard as units of their own: both, when they exist and do not share a weight
    (a tied table stays in the root, where both uses see one gathered copy)."""
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if emb is None or head is None or getattr(emb, "weight", None) is getattr(head, "weight", None):
        return None, None
    return emb, head
