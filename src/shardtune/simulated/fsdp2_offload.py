"""FSDP2 (`engine.backend=torch`) under cpu_offload on the simulated GPU: its shards on the simulated host.

FSDP2 moves a shard to the host (and pins it) only when it has values: sharded on meta, as the simulated GPU shards,
its offloaded shards would stay meta, the device's, and its lazy init refuses them. A real run fills them on the
host (engine/fsdp2_init.py `fill_local_shards(host=True)`); here each becomes a simulated host buffer of FSDP2's
padded size (simulated/host.py: no bytes, counted as host memory), pinned at its exact size as `host_resident`'s.
FSDP2's own steps then run as on a GPU: the non-blocking H2D copy before each all-gather makes a device tensor, each
reduced gradient's D2H copy a host one (simulated/device.py's `_to_copy`), AdamW steps on the host.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from shardtune import accelerator
from shardtune.simulated.host import host_empty


def is_nf4(t: torch.Tensor) -> bool:
    """A QLoRA weight as FSDP2 holds it: torchao's NF4Tensor (imported only when QLoRA runs on FSDP2)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    return isinstance(t, NF4Tensor)


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return accelerator.simulated_pinned_buffer(
        lambda: host_empty(t.numel(), t.dtype, accelerator.SIMULATED).view(t.shape), "exact")


def _offload_nf4(fsdp_param) -> None:
    """QLoRA: torchao's NF4 shard moved to the host part by part, as its `.cpu()` and `pin_memory()` move it (each
    part pinned at its size); the parameter's local tensor is the first rows of it, views of the same parts."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    flat, local = fsdp_param._sharded_param_data, fsdp_param.sharded_param._local_tensor
    names = flat.__tensor_flatten__()[0]
    parts = {a: _pinned_like(getattr(flat, a)) for a in names}
    fsdp_param._sharded_param_data = NF4Tensor(*construct_nf4_args(flat, parts))
    # the local tensor's parts are the first elements of the padded shard's (FSDP2 narrows dim 0)
    views = {a: parts[a].reshape(-1).narrow(0, 0, getattr(local, a).numel()).view(getattr(local, a).shape)
             for a in names}
    fsdp_param.sharded_param._local_tensor = NF4Tensor(*construct_nf4_args(local, views))


def offload_shards(fsdp_modules: list[nn.Module]) -> None:
    """Every FSDP2 parameter's shard of `fsdp_modules` (their `fully_shard` ran on meta) on the simulated host.
    FSDP2 keeps two views of it: the padded flat buffer its all-gather copies in, and the parameter's DTensor local
    tensor, the first `length` rows of that buffer (as `FSDPParam._init_sharded_param` makes them)."""
    for module in fsdp_modules:
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            padded = fsdp_param.padded_sharded_param_size
            flat = fsdp_param._sharded_param_data
            assert flat.is_meta and fsdp_param.fsdp_placement.dim == 0, "sharded on the simulated GPU, dim 0"
            if is_nf4(flat):
                _offload_nf4(fsdp_param)
                continue
            buf = accelerator.simulated_pinned_buffer(
                lambda n=math.prod(padded), dt=flat.dtype: host_empty(n, dt, accelerator.SIMULATED), "exact")
            rows = fsdp_param.sharded_param._local_tensor.size(0) if len(padded) else 0
            fsdp_param._sharded_param_data = buf
            fsdp_param.sharded_param._local_tensor = buf.view(padded).narrow(0, 0, rows) if len(padded) else \
                buf.view(padded)
