"""engine.backend=torch: the model is sharded by FSDP2 while its parameters are still on meta, then each rank makes
only its own chunk of every parameter, read from the checkpoint files or drawn by the seeded init.

Why: materialising the whole model on every GPU first, then letting `fully_shard` keep each rank's chunk, needs the
whole model in device memory at setup (a 70B model in fp32 is 263 GiB on a 24 GB card). Here a rank holds its
chunks, plus, for a random init, one module whole on the host while it is drawn (the seeded init draws each module
whole, so the values equal `init_full`'s at every world size).

How: `fully_shard` on meta gives DTensor parameters whose local tensors are meta. Each is replaced, at every module
holding it (tied weights stay one parameter), by a new DTensor parameter of the same global shape and placements
whose local tensor is the rank's rows (FSDP2 shards dim 0: `compute_local_shape_and_global_offset` gives them). FSDP2
adopts the new parameters at its lazy init (`FSDPParam.reset_sharded_param`: it pads them, and pins them under
cpu_offload). The local chunk lives on the host under cpu_offload (FSDP2's offload policy wants it there), else on
the device.

QLoRA: torchao quantizes whole weights into NF4Tensor parameters before `fully_shard` (its FSDP2 hooks shard them).
`quantized_weights_maker` makes one unit's quantized weights just before FSDP2 shards that unit, one weight at a time;
everything else is filled as above, after sharding. A rank holds the shards so far, one unit's NF4 weights whole and
one weight's transients, never the whole model.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardtune import accelerator
from shardtune.model.loading import CheckpointFiles, checkpoint_key, read_flat_range
from shardtune.model.seeded_init import by_module, init_module


def fill_local_shards(model: nn.Module, *, device: torch.device, host: bool, pretrained: Path | None, seed: int,
                      dtype: torch.dtype) -> None:
    """Every parameter whose local chunk is still on meta gets this rank's rows: from `pretrained`'s files, else
    drawn (seeded, in `dtype`). `host`: the chunks live on the host (cpu_offload)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if isinstance(p, DTensor) and p.to_local().is_meta:
                holders.setdefault(id(p), []).append((m, attr))
    names = [n for n, p in model.named_parameters() if id(p) in holders]  # tied weights once, by their first name
    where = torch.device("cpu") if host else device
    with CheckpointFiles(pretrained) if pretrained is not None else contextlib.nullcontext() as ckpt:
        for path, attrs in by_module(names).items():
            module = model.get_submodule(path)
            old = [module._parameters[a] for a in attrs]
            if ckpt is None:
                chunks = _drawn_chunks(model, path, module, attrs, old, seed=seed, dtype=dtype)
            else:
                chunks = [_read_chunk(ckpt, checkpoint_key(f"{path}.{a}" if path else a), p)
                          for a, p in zip(attrs, old, strict=True)]
            for p_old, chunk in zip(old, chunks, strict=True):
                # a fresh tensor: a chunk is a view of the whole weight's storage (read from the files, or drawn)
                local = torch.empty(chunk.shape, dtype=p_old.dtype, device=where).copy_(chunk)
                new = nn.Parameter(DTensor.from_local(local, p_old.device_mesh, p_old.placements, run_check=False,
                                                      shape=p_old.shape, stride=p_old.stride()),
                                   requires_grad=p_old.requires_grad)
                for m, attr in holders[id(p_old)]:
                    m._parameters[attr] = new
        if ckpt is not None:
            ckpt.load_buffers(model)


def quantized_weights_maker(model: nn.Module, entries: list, *, device: torch.device,
                            ckpt: CheckpointFiles | None, seed: int, dtype: torch.dtype,
                            compute: torch.dtype) -> Callable[[nn.Module], None]:
    """QLoRA on FSDP2: a callable that, given a module FSDP2 is about to shard (torch_backend.shard_model's
    `before_shard`), makes that module's quantized weights (`entries`: (name, param, locations) of
    layout.group_unit_params' `quantized`) not made yet, one at a time: read from `ckpt` (in the model's dtype on the
    host), or drawn whole with the seeded init (in `dtype`), or taken as they are (already made, or meta on the
    simulated GPU); quantized onto `device` in chunks through `compute` (nf4.quantize: bit-identical to torchao's
    `to_nf4`, whose own transients are 2 x 16 values per element of the weight, up to 1 Mi elements), into an
    NF4Tensor parameter owning its parts. The values equal a whole-model load or init, then quantization."""
    from shardtune.engine.nf4 import nf4_owning, quantize
    from shardtune.engine.nf4_layout import Nf4Layout

    path_of = {id(m): n for n, m in model.named_modules()}
    pending = {name: (p, locations) for name, p, locations in entries}

    def make(module: nn.Module) -> None:
        prefix = path_of[id(module)]
        for name in [n for n in pending if not prefix or n.startswith(prefix + ".")]:
            p, locations = pending.pop(name)
            if not p.is_meta or accelerator.is_simulated(device):  # the simulated GPU's weights have no values
                w = p.detach()
            elif ckpt is not None:
                key = checkpoint_key(name)
                w = ckpt.handle(key).get_tensor(key).to(p.dtype)
            else:
                path, _, attr = name.rpartition(".")
                w = _drawn(model, path, model.get_submodule(path), [attr], [p.shape], seed=seed, dtype=dtype)[0]
            layout = Nf4Layout.of(p.shape, compute)
            flat = w.reshape(-1)
            nf4 = nf4_owning(quantize(lambda a, m, flat=flat: flat[a:a + m], layout, device), layout)
            param = nn.Parameter(nf4, requires_grad=False)
            for holder, attr in locations:
                holder._parameters[attr] = param
            del w, flat

    return make


def _rows(p: DTensor) -> tuple[int, int]:
    """(first row, row count) of this rank's chunk: FSDP2 shards dim 0, replicas hold the same rows."""
    assert all(isinstance(pl, Shard) and pl.dim == 0 or pl.is_replicate() for pl in p.placements), p.placements
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0], shape[0]) if p.dim() else (0, 1)


def _read_chunk(ckpt: CheckpointFiles, key: str, p: DTensor) -> torch.Tensor:
    first, count = _rows(p)
    row = math.prod(p.shape[1:])
    local_shape = (count, *p.shape[1:]) if p.dim() else ()
    if count == 0:
        return torch.empty(local_shape, dtype=p.dtype)
    return read_flat_range(ckpt.handle(key), key, first * row, count * row).reshape(local_shape)


def _drawn_chunks(model: nn.Module, path: str, module: nn.Module, attrs: list[str], old: list[DTensor], *, seed: int,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """The module drawn whole on the host (as `init_full` draws it), then cut to this rank's rows."""
    chunks = []
    for p, w in zip(old, _drawn(model, path, module, attrs, [p.shape for p in old], seed=seed, dtype=dtype),
                    strict=True):
        first, count = _rows(p)
        chunks.append(w[first:first + count] if p.dim() else w)
    return chunks


@torch.no_grad()
def _drawn(model: nn.Module, path: str, module: nn.Module, attrs: list[str], shapes: list[torch.Size], *, seed: int,
           dtype: torch.dtype) -> list[torch.Tensor]:
    """`module`'s parameters `attrs` drawn whole on the host with the module's seeded init (as `init_full` draws
    them); the module's own parameters are put back."""
    old = [module._parameters[a] for a in attrs]
    whole = [nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False) for shape in shapes]
    for a, w in zip(attrs, whole, strict=True):
        module._parameters[a] = w  # the init reads the module's own parameters
    init_module(model, path, module, seed=seed)
    for a, p in zip(attrs, old, strict=True):
        module._parameters[a] = p  # put back until the caller installs what it keeps
    return [w.data for w in whole]
