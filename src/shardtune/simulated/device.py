"""The simulated GPU, installed into torch: its process-group backend, its device module, and the stand-ins for
what a CPU build lacks. Simulation only (`plan --simulate`, tests/simulated): `install()` is never called on a real
run. The seam itself (streams, events, the TRACE, pinned-buffer bookkeeping) is accelerator.py.

  - The "simgpu" backend for the meta device (simulated/process_group.py): collectives on meta tensors complete at
    once and move nothing; what NCCL refuses is refused; every rank's collectives are matched in order.
  - This module as `torch.meta`: PyTorch FSDP2 (`engine.backend=torch`) and DeviceMesh reach the device through
    `torch.<device type>` (current device, streams, events), as they reach `torch.cuda`; torch's registration API
    for an out-of-tree device (`torch._register_device_module`) makes this module that. Its streams and events are
    the seam's own, so FSDP2's schedule is recorded in the same TRACE as our engine's.
  - Host reads of a meta tensor (`.item()`, `bool()`) give zero and are counted as host syncs; host<->device copies
    CUDA would run synchronously are counted; `Tensor.is_pinned()` reports the seam's pinned buffers as pinned.
  - A device tensor copied to the host (`Tensor.to("cpu")`) becomes a simulated host tensor (simulated/host.py), so
    FSDP2's gradient offload costs no host bytes here whatever the model's size.
"""
from __future__ import annotations

import functools
import itertools
import sys
from typing import Any

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.simulated import host, rms_norm

_STREAM_IDS = itertools.count()


class Stream(accelerator.SimStream):
    """A side stream FSDP2 creates (all-gather, reduce-scatter, all-reduce); `priority` has no meaning here."""

    def __init__(self, priority: int = 0, **_: Any) -> None:
        super().__init__(f"fsdp{next(_STREAM_IDS)}")

    def record_event(self, event: accelerator.SimEvent | None = None) -> accelerator.SimEvent:
        event = event or accelerator.SimEvent()
        event.record(self)
        return event


def Event(**_: Any) -> accelerator.SimEvent:  # noqa: N802 - torch.cuda's name
    return accelerator.SimEvent()


def current_stream(device: Any = None) -> accelerator.SimStream:
    return accelerator.current_stream(accelerator.SIMULATED)


def stream(s: accelerator.SimStream | None) -> Any:
    return accelerator.use_stream(s)


def synchronize(device: Any = None) -> None:
    accelerator.synchronize(accelerator.SIMULATED)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def device_count() -> int:
    return 1  # one simulated GPU per rank process


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    """Every rank process has its one simulated GPU already."""


def install() -> None:
    """Register the backend, the device module and the stand-ins (once per process)."""
    if accelerator.SIM_BACKEND.upper() in dist.Backend.backend_list or \
            accelerator.SIM_BACKEND in dist.Backend.backend_list:
        return
    from shardtune.simulated.process_group import create_group

    dist.Backend.register_backend(accelerator.SIM_BACKEND, create_group, extended_api=True, devices=["meta"])
    if getattr(torch, "meta", None) is None:
        torch._register_device_module("meta", sys.modules[__name__])
        _allow_fsdp2_meta_parameters()
    torch.Tensor.is_pinned = _is_pinned  # type: ignore[method-assign]
    _route_torch_accelerator_streams()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_local_scalar_dense", _zero_scalar, "Meta")
    lib.impl("copy_", _meta_copy, "Meta")
    lib.impl("_to_copy", _meta_to_copy, "Meta")
    _LIBS.append(lib)
    _native_meta_kernels()
    rms_norm.install(_LIBS)  # F.rms_norm as CUDA runs it: one fused kernel each way


_LIBS: list[Any] = []  # keeps the simulated kernels registered


# Ops with no C++ meta kernel whose C++ composite (it allocates through empty_strided) serves the meta device: the
# step's most frequent op without one (~100k calls in a 70B QLoRA step).
_COMPOSITE_IN_CPP = {"aten::empty_like"}


def _native_meta_kernels() -> None:
    """Put ATen's own C++ meta kernels back in front of torch's Python ones, where ATen has one.

    `import torch` registers a Python meta kernel (torch/_meta_registrations.py, mostly `torch._refs`) for 1,337 aten
    ops, over the C++ one where one exists, so that symbolic shapes trace through them. A simulated step runs every
    op on meta tensors with concrete shapes, where the Python kernel costs 100-1,000 us an op (`a + b` on two meta
    256x256 tensors: ~930 us) and the C++ one ~2 us: the structured kernels' meta function, the one CUDA's kernels
    size their outputs with. The Python kernels stay for the ops ATen has no meta kernel for, and as `py_kernels`
    for torch's Python dispatcher (FakeTensor, compile), which does not read these registrations. Skipped, and the
    simulation only slower, if this torch lays its registrations out otherwise."""
    import torch._meta_registrations as registrations

    python_meta = getattr(registrations, "_meta_lib_dont_use_me_use_register_meta", None)
    if python_meta is None or python_meta.m is None or not hasattr(python_meta, "_op_impls"):
        return
    ops = []
    for key in python_meta._op_impls:  # "aten/add.Tensor/Meta"
        namespace, name, _ = key.split("/")
        base, _, overload = name.partition(".")
        ops.append(getattr(getattr(getattr(torch.ops, namespace), base), overload or "default"))
    kernels = {op: op.py_kernels.get(torch._C.DispatchKey.Meta) for op in ops}
    if any(kernel is None for kernel in kernels.values()):
        return  # a registration we could not put back: keep them all
    python_meta._destroy()
    kept = torch.library.Library("aten", "IMPL")
    for op, kernel in kernels.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") and op.name() not in _COMPOSITE_IN_CPP:
            kept.impl(op, kernel, "Meta")
    _LIBS.append(kept)


def _is_pinned(self: torch.Tensor, *args: Any) -> bool:
    """A CPU build has no pinned allocator: the simulated GPU's pinned buffers are plain host tensors, reported
    pinned as they would be on CUDA (what DCP's and ShardedTensor's checks read)."""
    return accelerator.simulated_pinned(self)


def _zero_scalar(t: torch.Tensor) -> bool | int | float:
    """A host read of a meta tensor (`.item()`, `bool()`, a Python branch on a tensor) gives zero, as `to_host`
    does, instead of raising; it is a host sync."""
    accelerator.host_sync("item")
    if t.dtype == torch.bool:
        return False
    return 0.0 if t.dtype.is_floating_point else 0


def _meta_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """copy_ where either side is the simulated GPU: nothing moves (a host destination reads zeros); a copy CUDA
    would run synchronously is counted."""
    if src.device.type == "cpu" and not (non_blocking and src.is_pinned()):
        accelerator.host_sync("h2d_pageable")
    if dst.device.type == "cpu":
        if not (non_blocking and dst.is_pinned()):
            accelerator.host_sync("d2h_pageable")
        with torch._C._DisableTorchDispatch():
            dst.zero_()
    return dst


def _meta_to_copy(t: torch.Tensor, *, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
                  pin_memory: bool | None = None, non_blocking: bool = False,
                  memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """`Tensor.to` of a simulated GPU tensor: to the host, a simulated host tensor (simulated/host.py: no host bytes
    allocated, any size; CUDA would copy a non-blocking one into pinned memory, a blocking one is a host sync);
    otherwise a new meta tensor as torch's own meta kernel makes it."""
    like = functools.partial(torch.empty_like, t, dtype=dtype or t.dtype, device="meta",
                             memory_format=memory_format or torch.preserve_format)
    if not t.is_meta:  # a host tensor to the simulated GPU (the target device picked this kernel)
        return like().copy_(t, non_blocking=non_blocking)
    if device is None or torch.device(device).type != "cpu":
        return like()
    if isinstance(t, host.HostMeta):
        return host.host_like(like)
    if not non_blocking:
        accelerator.host_sync("d2h_pageable")
        return host.host_like(like)
    return accelerator.simulated_pinned_buffer(lambda: host.host_like(like), "cached")


def _route_torch_accelerator_streams() -> None:
    """FSDP2 waits on a prefetched all-gather that backward never used (LoRA, QLoRA: a frozen unit) through
    `torch.accelerator.current_stream()`, which knows no simulated GPU: while the default group is the simulated
    GPU's, that stream is the simulated one (a real accelerator beside it keeps its own)."""
    real = torch.accelerator.current_stream

    def current_stream(device: Any = None) -> Any:
        if dist.is_initialized() and dist.get_backend() == accelerator.SIM_BACKEND:
            return accelerator.current_stream(accelerator.SIMULATED)
        return real(device)

    torch.accelerator.current_stream = current_stream


def _allow_fsdp2_meta_parameters() -> None:
    """FSDP2's lazy init refuses parameters still on meta (a deferred init the user forgot to materialise), and,
    under cpu_offload, shards not on the CPU. On the simulated GPU meta IS the device, and the simulated host is meta
    too: both checks are skipped for param groups on it, and only there. The only overrides of private torch methods
    in the simulation, installed with the simulated backend, never on a real run; without them
    `engine.backend=torch` cannot run a simulated step."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    validate = FSDPParamGroup._validate_no_meta_params

    def validate_off_the_simulated_gpu(group: FSDPParamGroup) -> None:
        if group.device.type != "meta":
            validate(group)

    FSDPParamGroup._validate_no_meta_params = validate_off_the_simulated_gpu  # type: ignore[method-assign]

    validate_offload = FSDPParamGroup._validate_cpu_offload_params

    def validate_offload_off_the_simulated_gpu(group: FSDPParamGroup) -> None:  # its host is meta too (host.py)
        if group.device.type != "meta":
            validate_offload(group)

    FSDPParamGroup._validate_cpu_offload_params = validate_offload_off_the_simulated_gpu  # type: ignore[method-assign]
