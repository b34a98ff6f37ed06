"""The simulated GPU's device module: what `torch.cuda` is to FSDP2, for the meta device.

PyTorch FSDP2 (`engine.backend=torch`) and DeviceMesh reach the device through `torch.<device type>` (current
device, streams, events). torch's registration API for an out-of-tree device (`torch._register_device_module`)
makes this module `torch.meta`; its streams and events are the simulated GPU's own (accelerator.py), so FSDP2's
schedule is recorded in the same TRACE as our engine's. Simulation only: registered with the simulated backend,
never on a real run.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from shardtune import accelerator

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


def register() -> None:
    """Make this module `torch.meta` (once per process), and let FSDP2 train parameters on the meta device."""
    import sys

    if getattr(torch, "meta", None) is None:
        torch._register_device_module("meta", sys.modules[__name__])
        _allow_fsdp2_meta_parameters()


def _allow_fsdp2_meta_parameters() -> None:
    """FSDP2's lazy init refuses parameters still on meta (a deferred init the user forgot to materialise). On the
    simulated GPU meta IS the device: the check is skipped for param groups on it, and only there. The one override
    of a private torch method in the simulation (beside the pinned-memory and host-read stand-ins of
    accelerator.py), installed with the simulated backend, never on a real run; without it `engine.backend=torch`
    cannot run a simulated step."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    validate = FSDPParamGroup._validate_no_meta_params

    def validate_off_the_simulated_gpu(group: FSDPParamGroup) -> None:
        if group.device.type != "meta":
            validate(group)

    FSDPParamGroup._validate_no_meta_params = validate_off_the_simulated_gpu  # type: ignore[method-assign]
