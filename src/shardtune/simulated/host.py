"""The simulated host: host (CPU) tensors of any size that cost nothing, for `plan --simulate` at full size (a 70B
model's offloaded shards are 100+ GB, which this machine cannot allocate).

A `HostMeta` is a meta tensor marked as host memory. Ops on one stay on the host: what they allocate is host
memory to the memory tracker (`is_host`). Its non-blocking copy to the device (`.to(device, non_blocking=True)`, the
H2D copy of accelerator.copy_to_device and of FSDP2's offload) makes a plain meta tensor, the device's, as the copy
on a GPU does. The other way, a device tensor copied to the host (`.to("cpu")`, FSDP2's gradient offload) gives a
HostMeta (simulated/device.py's `_to_copy`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_HOST = threading.local()  # .depth: HostMeta ops running now: their new storages are host memory


def _in_host_op() -> bool:
    return getattr(_HOST, "depth", 0) > 0


class HostMeta(torch.Tensor):
    """A simulated host tensor: meta storage; see the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            # positional or keyword: torchao's NF4 passes `non_blocking` to each part's `to` positionally
            to_args = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to knows no `copy`
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **to_args)
            if non_blocking and device is not None and device.type != "cpu":  # the H2D copy: a device tensor
                with torch._C.DisableTorchFunctionSubclass():
                    return torch.empty(args[0].shape, dtype=dtype or args[0].dtype, device="meta")
        _HOST.depth = getattr(_HOST, "depth", 0) + 1
        try:
            return super().__torch_function__(func, types, args, kwargs)
        finally:
            _HOST.depth -= 1


def is_host(t: torch.Tensor | None) -> bool:
    """The memory tracker's question: is `t` (or, None, whatever is being allocated now) host memory?"""
    return isinstance(t, HostMeta) if t is not None else _in_host_op()


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    """A 1-D simulated host buffer (`plan --simulate`'s `accelerator.make_host_buffer`)."""
    return host_like(lambda: torch.empty(numel, dtype=dtype, device="meta"))


def host_like(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The meta tensor `make()` returns, as a simulated host tensor (made while host ops count)."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        with torch._C.DisableTorchFunctionSubclass():
            meta = make()
        return torch.Tensor._make_subclass(HostMeta, meta)
    finally:
        _HOST.depth -= 1
