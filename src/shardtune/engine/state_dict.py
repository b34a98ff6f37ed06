"""Our engine's checkpoint state: per-original-parameter keys, so a checkpoint loads at another world size.

Each trainable parameter is saved flattened (1-D, numel of the parameter) as a ShardedTensor whose chunks are the
pieces of it that each rank's flat shard holds, at their offsets in the parameter. The chunks are views of the
shard (and of the AdamW state of the shard's segments), so `dcp.load` writes straight into the engine's memory, and
DCP reslices chunks when the saving and loading layouts differ (2 -> 4 ranks, 2 -> 1, another padding...).
The metadata of every rank's chunks is computed locally (the layout is deterministic): no collective per key.

Replicas (no_shard, hybrid_shard) hold identical shards: only the first shard group (global ranks 0..S-1) owns
chunks; after a load it broadcasts them over each replicate group. Frozen parameters are not saved: they come back
from the recipe (pretrained weights or the seeded init).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from shardtune.engine.flat_param import FlatParam

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's lazy state now (zeros, step 0) so a checkpoint can be loaded into it in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for k in OPTIM_KEYS:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sharded(flat: FlatParam, slot_index: int, local: torch.Tensor | None, shard_rank: int,
             placement_device: str) -> ShardedTensor:
    """A 1-D ShardedTensor over one parameter: chunk metadata for every shard rank, data for this one."""
    slot = flat.slots[slot_index]
    metas, mine = [], []
    for r in range(flat.shard_size):
        for i, p_start, _, n in flat.pieces(r):
            if i == slot_index:
                m = ShardMetadata(shard_offsets=[p_start], shard_sizes=[n], placement=f"rank:{r}/{placement_device}")
                metas.append(m)
                if r == shard_rank and local is not None:
                    mine.append(Shard(tensor=local, metadata=m))
    props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([slot.numel]), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta)


def checkpoint_state(units: list, shard_rank: int, shard_size: int, optimizer: torch.optim.Optimizer,
                     module: nn.Module) -> dict[str, Any]:
    """{"model.<name>": ShardedTensor, "optim.<name>.exp_avg": ..., "optim.step": tensor, "replicated.<name>": ...}"""
    init_optimizer_state(optimizer)
    rank = dist.get_rank()
    owner = rank < shard_size  # the first shard group owns the chunks; replicas only receive
    out: dict[str, Any] = {}
    step = None
    for unit in units:
        for flat in unit.flats:
            if not flat.requires_grad:
                continue  # frozen: rebuilt from the recipe, never re-saved
            device = flat.shard.device
            dev = f"{device.type}:{device.index}" if device.type == "cuda" else "cpu"
            local_model: dict[int, torch.Tensor] = {}
            local_opt: dict[int, dict[str, torch.Tensor]] = {}
            if owner:
                for i, _, s_start, n in flat.pieces(shard_rank):
                    local_model[i] = flat.shard[s_start:s_start + n]
                    for _, a, b, seg in flat.segments:
                        if a <= s_start < b:
                            st = optimizer.state[seg]
                            step = st["step"]
                            local_opt[i] = {k: st[k][s_start - a:s_start - a + n] for k in OPTIM_KEYS}
            for i, slot in enumerate(flat.slots):
                out[f"model.{slot.name}"] = _sharded(flat, i, local_model.get(i), shard_rank, dev)
                for k in OPTIM_KEYS:
                    t = local_opt[i][k] if i in local_opt else None
                    out[f"optim.{slot.name}.{k}"] = _sharded(flat, i, t, shard_rank, dev)
    for name, p in _replicated_params(module):
        out[f"replicated.{name}"] = p.data
        st = optimizer.state.get(p)
        if st:
            step = st["step"]
            for k in OPTIM_KEYS:
                out[f"replicated_optim.{name}.{k}"] = st[k]
    out["optim.step"] = step.clone() if step is not None else torch.tensor(0.0)
    return out


def _replicated_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters outside the flat buffers (e.g. LoRA adapters): identical on every rank."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and "_shardtune_flat_" not in n]


def after_load(state: dict[str, Any], units: list, shard_group_size: int, replicate_group,
               optimizer: torch.optim.Optimizer) -> None:
    """Set every AdamW step counter and copy the loaded chunks from the first shard group to its replicas."""
    step = state["optim.step"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["step"] = step.clone()
    if replicate_group is None:
        return
    src = dist.get_rank() % shard_group_size  # the member of my replicate group that is in the first shard group
    for unit in units:
        for flat in unit.flats:
            if flat.requires_grad:
                dist.broadcast(flat.shard, src=src, group=replicate_group)
                for _, _, _, seg in flat.segments:
                    for k in OPTIM_KEYS:
                        dist.broadcast(optimizer.state[seg][k], src=src, group=replicate_group)
