"""Our engine's checkpoint state: per-original-parameter keys, so a checkpoint loads at another world size.

Each trainable parameter is saved flattened (1-D, numel of the parameter) as a ShardedTensor whose chunks are the
pieces of it that each rank's flat shard holds, at their offsets in the parameter. The chunks are views of the
shard (and of the AdamW state of the shard's segments), so `dcp.load` writes straight into the engine's memory, and
DCP reslices chunks when the saving and loading layouts differ (2 -> 4 ranks, 2 -> 1, another padding...).
The metadata of every rank's chunks is computed locally (the layout is deterministic): no collective per key.

Replicas (no_shard, hybrid_shard) hold identical shards: on save only the first shard group (global ranks 0..S-1)
owns chunks (one copy on disk). On load every rank reads its own chunks from the files (the chunk metadata then
places them on its own shard group's ranks), so no state goes through a collective: under CPU offload the shards and
AdamW state live on the host, and a broadcast of host tensors over an NCCL group would fail (staging them through the
device instead would cost 3 shard sizes of device memory and a round trip). Cost: each replica group reads the
checkpoint from storage. Frozen parameters are not saved: they come back from the recipe (pretrained weights or the
seeded init).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from shardtune import accelerator
from shardtune.engine.flat_param import FlatParam

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def _device_step(group: dict[str, Any]) -> bool:
    """AdamW keeps `step` on the parameter's device for its fused and capturable kernels (which read it as a
    device address), on the host otherwise (torch's own rule, optim/adam.py)."""
    return bool(group.get("fused") or group.get("capturable"))


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's lazy state now (zeros, step 0) so a checkpoint can be loaded into it in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = accelerator.step_tensor(p, fused=_device_step(group))
                for k in OPTIM_KEYS:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sharded(flat: FlatParam, slot_index: int, local: torch.Tensor | None, shard_rank: int,
             placement_device: str, first_rank: int) -> ShardedTensor:
    """A 1-D ShardedTensor over one parameter: chunk metadata for every shard rank (shard rank r is global rank
    first_rank + r), data for this one."""
    slot = flat.slots[slot_index]
    metas, mine = [], []
    for r in range(flat.shard_size):
        for i, p_start, _, n in flat.pieces(r):
            if i == slot_index:
                m = ShardMetadata(shard_offsets=[p_start], shard_sizes=[n],
                                  placement=f"rank:{first_rank + r}/{placement_device}")
                metas.append(m)
                if r == shard_rank and local is not None:
                    mine.append(Shard(tensor=local, metadata=m))
    # Described as the chunk is: ShardedTensor refuses a pinned chunk (offload on an accelerator) said unpinned.
    props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format,
                             pin_memory=local is not None and local.is_pinned())
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([slot.numel]), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta)


def checkpoint_state(units: list, shard_rank: int, shard_size: int, optimizer: torch.optim.Optimizer,
                     module: nn.Module, *, for_load: bool = False) -> dict[str, Any]:
    """{"model.<name>": ShardedTensor, "optim.<name>.exp_avg": ..., "optim.step": tensor, "replicated.<name>": ...}
    `for_load`: every rank holds its chunks (read in place by `dcp.load`); else only the first shard group does."""
    init_optimizer_state(optimizer)
    rank = dist.get_rank()
    owner = for_load or rank < shard_size
    # Shard groups are consecutive ranks (shard.build_groups): on load mine starts at rank - shard_rank; on save the
    # chunks are described on the first group's ranks, the only ones that hold them.
    first_rank = rank - shard_rank if for_load else 0
    out: dict[str, Any] = {}
    for unit in units:
        for flat in unit.flats:
            if not flat.requires_grad:
                continue  # frozen: rebuilt from the recipe, never re-saved
            device = flat.shard.device
            dev = str(device)  # cpu, cuda:N, meta (the simulated GPU)
            local_model: dict[int, torch.Tensor] = {}
            local_opt: dict[int, dict[str, torch.Tensor]] = {}
            if owner:
                for i, _, s_start, n in flat.pieces(shard_rank):
                    local_model[i] = flat.shard[s_start:s_start + n]
                    for _, a, b, seg in flat.segments:
                        if a <= s_start < b:
                            st = optimizer.state[seg]
                            local_opt[i] = {k: st[k][s_start - a:s_start - a + n] for k in OPTIM_KEYS}
            for i, slot in enumerate(flat.slots):
                out[f"model.{slot.name}"] = _sharded(flat, i, local_model.get(i), shard_rank, dev, first_rank)
                for k in OPTIM_KEYS:
                    t = local_opt[i][k] if i in local_opt else None
                    out[f"optim.{slot.name}.{k}"] = _sharded(flat, i, t, shard_rank, dev, first_rank)
    for name, p in _replicated_params(module):
        # detach(), not .data: it shares p's version counter, so dcp.load's in-place write is a change of p that
        # a cache keyed on versions sees (model/lora_linear.py compute_adapters' bf16 copies)
        out[f"replicated.{name}"] = p.detach()
        st = optimizer.state.get(p)
        if st:
            for k in OPTIM_KEYS:
                out[f"replicated_optim.{name}.{k}"] = st[k]
    # Every rank steps every parameter the same number of times: take the counter from any state this rank has,
    # owner of chunks or not. (A replica that wrote 0 here could be the copy DCP keeps of this replicated key, and a
    # resume would restart AdamW's bias correction at step 0: the bug this replaced.)
    states = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"]]
    step = next((st["step"] for st in states if "step" in st), None)
    # Saved as a host scalar whatever the kernel's placement (a device step would be saved with its device).
    out["optim.step"] = accelerator.to_host(step).clone() if step is not None else torch.tensor(0.0)
    return out


def _replicated_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters outside the flat buffers (e.g. LoRA adapters): identical on every rank."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and "_shardtune_flat_" not in n]


def after_load(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Set every AdamW step counter (saved once, a scalar). The chunks were read in place by every rank."""
    step = state["optim.step"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["step"] = accelerator.step_tensor(p, fused=_device_step(group), value=step)
