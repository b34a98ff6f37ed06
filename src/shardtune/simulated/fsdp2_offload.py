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

from torch import nn

from shardtune import accelerator
from shardtune.simulated.host import host_empty


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
            buf = accelerator.simulated_pinned_buffer(
                lambda n=math.prod(padded), dt=flat.dtype: host_empty(n, dt, accelerator.SIMULATED), "exact")
            rows = fsdp_param.sharded_param._local_tensor.size(0) if len(padded) else 0
            fsdp_param._sharded_param_data = buf
            fsdp_param.sharded_param._local_tensor = buf.view(padded).narrow(0, 0, rows) if len(padded) else \
                buf.view(padded)
