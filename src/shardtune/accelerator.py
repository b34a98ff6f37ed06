"""The device seam: everything that differs between the host (CPU, gloo), a CUDA GPU and the simulated GPU.

Three kinds of compute device:
  cpu    the host is the device: no streams (everything runs in program order), no pinned memory, gloo.
  cuda   plain torch.cuda: streams, events, pinned host buffers, NCCL.
  meta   the simulated GPU (tests/simulated, `plan --simulate`): the engine takes the GPU branch on meta tensors
         (shapes, dtypes and devices, no bytes); a process group registered for the meta device only
         (simulated/process_group.py) runs the collectives without moving anything, refuses what NCCL refuses (a
         CPU tensor: "No backend type associated with device type cpu"; a non-contiguous one; wrong sizes) and
         matches every collective across ranks in order; streams and events are stand-ins that record, in order,
         what was issued on which stream and what waited on what (`TRACE`). A meta tensor holds no values: a host read of one
         (`to_host`, `item`, and under simulation `.item()` / `bool()` too) gives zeros. Host buffers cannot be
         pinned on a CPU build: under simulation the ones `host_empty` makes report `is_pinned()` True, as on
         CUDA (what ShardedTensor checks). The backend and these stand-ins are installed by
         `shardtune.simulated.device.install()`, never on a real run.
The engine, the runtime, the checkpoint code and the trainer ask this module, not `device.type` (left outside:
the launcher's GPU detection, the CUDA allocator's memory tracker, the CUDA RNG state). The CUDA path below is
exactly torch.cuda; the simulation code is the stand-ins at the end of each section.

API (`device` is the run's compute device; SIMULATED = torch.device("meta")):
  is_accelerator(device)             cuda or simulated: streams, pinned host buffers, device-resident collectives
  is_simulated(device)
  backend(device)                    the default process group's backend: nccl | simgpu | gloo
  init_process_group(device, *, rank, world_size, timeout, store=None)   default group + the host group
  host_group()                       a gloo group over all ranks for host-side coordination (checkpoint agreement,
                                     DCP planning, barriers); the default group itself when that is gloo
  compute_device(device_type, local_rank)  the torch.device a worker computes on (sets the CUDA device)
  new_stream(device, name)           a side stream (None on cpu: run inline)
  current_stream(device)             the stream work is issued on now (None on cpu)
  use_stream(stream)                 context: issue on `stream` (nullcontext for None)
  new_event(device)                  an event (None on cpu); .record(stream=None), .synchronize(), and
                                     stream.wait_event(event) / stream.wait_stream(other)
  record_stream(tensor, stream)      the allocator may reuse `tensor` only once `stream` is past this point
                                     (simulated: told to the allocator model, simulated/allocator.py)
  note(device, op, label)            record an op issued on the current stream (simulated only; no-op elsewhere)
  tracked(work, device, label)       a collective's work whose wait() is recorded (simulated only)
  host_empty(numel, dtype, device)   a 1-D host buffer for a transient copy, pinned when the device is an
                                     accelerator (CUDA: the caching host allocator, power-of-two blocks, cached)
  host_resident(numel, dtype, device)  a 1-D host buffer that lives as long as its owner (offloaded shards, the
                                     landing buffers of offloaded gradients): pinned at its exact size on CUDA
  pinned_kind(storage)               simulated: "cached" (host_empty), "exact" (host_resident) or None (pageable)
  to_device(tensor, device)          a host tensor (a batch) copied to the device without a host sync (via pinned)
  copy_to_device(src, device, *, out=None, copy=False, label="") -> (tensor, event)   the one H2D copy out of a
                                     pinned host buffer: non-blocking on the current stream, then an event recorded
                                     there (None on cpu, or when nothing was copied)
  host_wait(event)                   the CPU blocks until the device has passed `event` (None: nothing to wait for)
  host_sync(kind) / host_syncs()     the simulated GPU's count of host synchronizations (TRACE "host_sync")
  optimizer_flags(params)            AdamW's implementation: {"fused": True} when every param is on the host (the
                                     fused CPU kernel), else {"foreach": True}
  step_tensor(param, fused)          AdamW's `step` for `param`: on the param's device when fused (the fused CUDA
                                     kernel reads it as a device address), else a CPU scalar (torch's rule)
  to_host(tensor, dtype, copy=) / item(tensor)   a blocking device-to-host read (zeros on the simulated device)
  copy_to_host(dst, src)             a non-blocking device-to-host copy into a host buffer
  synchronize(device)                wait for all queued device work (no-op on cpu)
  set_matmul_precision(device, compute_dtype)  TF32 for the fp32 matmuls of a bf16 run on an accelerator
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SIM_BACKEND = "simgpu"
SIMULATED = torch.device("meta")


def is_simulated(device: torch.device) -> bool:
    return device.type == "meta"


def is_accelerator(device: torch.device) -> bool:
    return device.type == "cuda" or is_simulated(device)


def backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "nccl"
    return SIM_BACKEND if is_simulated(device) else "gloo"


def compute_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


# -- process groups --------------------------------------------------------------------------------------------------
_HOST_GROUP: list[Any] = []  # [group] once init_process_group ran


def init_process_group(device: torch.device, *, rank: int, world_size: int, timeout: timedelta,
                       store: dist.Store | None = None) -> None:
    """The default group on the device's backend, then the gloo host group (collective over all ranks)."""
    assert not is_simulated(device) or SIM_BACKEND.upper() in dist.Backend.backend_list \
        or SIM_BACKEND in dist.Backend.backend_list, \
        "the simulated GPU's backend is installed by shardtune.simulated.device.install()"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend(device), rank=rank, world_size=world_size, timeout=timeout, store=store, **kwargs)
    _HOST_GROUP.clear()
    _HOST_GROUP.append(dist.group.WORLD if backend(device) == "gloo" else dist.new_group(backend="gloo",
                                                                                         timeout=timeout))
    # gloo's connect returns on one rank before its peers have finished theirs: a rank that then stops at once (a
    # user error in setup) closed its sockets under a peer still connecting, whose traceback then hid the one line
    # (seen under load: "Gloo connectFullMesh failed ... Connection closed by peer"). No rank leaves before all
    # are connected.
    dist.barrier(group=host_group())


def init_host_group_alone() -> None:
    """`plan --simulate`: rank 0 stands alone for the world on the simulated GPU (no peers). Its host group is a gloo
    group of itself, so the host agreements a real run makes run here too and agree on rank 0's values (every
    rank's are alike there)."""
    _HOST_GROUP.clear()
    _HOST_GROUP.append(dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True))


def host_group() -> Any:
    """Gloo over all ranks, for host tensors on purpose (agreement flags, DCP's object collectives, barriers)."""
    if not _HOST_GROUP:  # a process group set up by someone else (tests' gloo harness): it is the host group
        assert dist.get_backend() == "gloo", "init_process_group (this module) creates the host group"
        return dist.group.WORLD
    return _HOST_GROUP[0]


def forget_host_group() -> None:
    """After destroy_process_group: the host group died with it."""
    _HOST_GROUP.clear()


# -- host synchronizations (simulated) -------------------------------------------------------------------------------
# Every point where a GPU run would block the CPU until the device caught up, recorded in TRACE as
# ("host_sync", "host", kind): a host read (`item`: .item()/bool()/a Python branch on a tensor; `to_host`), a copy
# between host and device that CUDA runs synchronously (`h2d_pageable`: from pageable memory, or from pinned memory
# without non_blocking; `d2h_pageable`: into pageable memory, or without non_blocking), and a full device sync
# (`synchronize`). `nonzero`, boolean-mask indexing and other data-dependent shapes have no meta kernel: under
# simulation they raise, louder than a count. Event waits (offload's host optimizer) are the TRACE's "host_wait".
def host_sync(kind: str) -> None:
    TRACE.add("host_sync", "host", kind, _caller())


def host_syncs() -> list[tuple[str, str]]:
    """(kind, caller "module:function") of the host synchronizations recorded since TRACE was last cleared."""
    return [(e[2], e[3]) for e in TRACE.entries if e[0] == "host_sync"]


_SEAM_MODULES = (__name__, "shardtune.simulated.device")  # a host sync's caller is outside these


def _caller() -> str:
    """The innermost frame outside torch, this module and dispatch modes (memory trackers): who asked for it."""
    import sys

    frame = sys._getframe(1)
    while frame is not None and (frame.f_globals.get("__name__") in _SEAM_MODULES
                                 or "/torch/" in frame.f_code.co_filename
                                 or frame.f_code.co_name == "__torch_dispatch__"):
        frame = frame.f_back
    return f"{frame.f_globals.get('__name__')}:{frame.f_code.co_name}" if frame is not None else "?"


# -- the simulated GPU's record --------------------------------------------------------------------------------------
@dataclass
class Trace:
    """What the simulated GPU was asked to do, in program order: tuples of
      ("op", stream, what, label)        an op issued on `stream` (what: all_gather, reduce_scatter, h2d, ...)
      ("record", stream, event_id)       an event recorded on `stream`
      ("wait_event", stream, event_id)   `stream` waits for the event
      ("wait_stream", stream, other)     `stream` waits for everything issued on `other` so far
      ("wait_work", stream, label)       `stream` waits for a collective (dist.Work.wait on CUDA)
      ("host_wait", "host", event_id)    the CPU blocks on the event
    """
    entries: list[tuple] = field(default_factory=list)
    enabled: bool = True
    listeners: list[Any] = field(default_factory=list)  # callables fed every entry (the allocator model)

    def add(self, *entry: Any) -> None:
        if self.enabled:
            self.entries.append(entry)
        self.tell(*entry)

    def tell(self, *entry: Any) -> None:
        """To the listeners only, not the record: ("record_stream", stream, storage id)."""
        for listen in self.listeners:
            listen(entry)

    def clear(self) -> None:
        self.entries.clear()


TRACE = Trace()
_EVENT_IDS = itertools.count()


class SimStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: SimEvent) -> None:
        TRACE.add("wait_event", self.name, event.id)

    def wait_stream(self, other: SimStream) -> None:
        TRACE.add("wait_stream", self.name, other.name)

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    def __init__(self) -> None:
        self.id = next(_EVENT_IDS)
        self.stream: str | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self.stream = (stream or _SIM_CURRENT[-1]).name
        TRACE.add("record", self.stream, self.id)

    def synchronize(self) -> None:
        TRACE.add("host_wait", "host", self.id)

    def query(self) -> bool:
        return True


_SIM_COMPUTE = SimStream("compute")
_SIM_CURRENT: list[SimStream] = [_SIM_COMPUTE]


class _TrackedWork:
    """A simulated collective's work: wait() is recorded on the stream current at the wait."""

    def __init__(self, work: Any, label: str) -> None:
        self._work, self.label = work, label

    def wait(self) -> bool:
        TRACE.add("wait_work", _SIM_CURRENT[-1].name, self.label)
        return self._work.wait() if self._work is not None else True

    def is_completed(self) -> bool:
        return True


# -- streams and events ----------------------------------------------------------------------------------------------
def new_stream(device: torch.device, name: str) -> Any:
    if device.type == "cuda":
        return torch.cuda.Stream(device)
    return SimStream(name) if is_simulated(device) else None


def current_stream(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return _SIM_CURRENT[-1] if is_simulated(device) else None


@contextlib.contextmanager
def _sim_stream(stream: SimStream):
    _SIM_CURRENT.append(stream)
    try:
        yield
    finally:
        _SIM_CURRENT.pop()


def use_stream(stream: Any) -> contextlib.AbstractContextManager:
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, SimStream):
        return _sim_stream(stream)
    return torch.cuda.stream(stream)


def new_event(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.Event()
    return SimEvent() if is_simulated(device) else None


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    if isinstance(stream, torch.cuda.Stream):
        tensor.record_stream(stream)
    elif isinstance(stream, SimStream):  # the allocator model (simulated/allocator.py) holds the block back
        TRACE.tell("record_stream", stream.name, id(tensor.untyped_storage()))


def note(device: torch.device, op: str, label: str = "") -> None:
    if is_simulated(device):
        TRACE.add("op", _SIM_CURRENT[-1].name, op, label)


def tracked(work: Any, device: torch.device, label: str) -> Any:
    return _TrackedWork(work, label) if is_simulated(device) and work is not None else work


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif is_simulated(device):
        TRACE.add("host_wait", "host", "all")
        host_sync("synchronize")


# -- host memory -----------------------------------------------------------------------------------------------------
_SIM_PINNED: dict[int, Any] = {}  # simulated pinned storages: data_ptr -> weakref to the storage
_SIM_KINDS: dict[int, tuple[Any, str]] = {}  # simulated pinned storages: id(storage) -> (weakref to it, kind)
_PINNING = threading.local()  # .kind while the seam makes a simulated pinned buffer in this thread


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    """A 1-D host buffer for a transient copy; pinned when `device` is an accelerator, so copies to and from it run
    asynchronously. CUDA: from the caching host allocator, which rounds each block up to a power of two and keeps
    it cached once freed: cheap to take again, but not for what lives as long as the run (`host_resident`)."""
    return _host_buffer(numel, dtype, device, zero, "cached")


def host_resident(numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    """A 1-D host buffer that lives as long as its owner (an offloaded shard, a gradient's landing buffer): pinned
    at its exact size when `device` is CUDA. The caching host allocator would round it up to a power of two (a
    760 MiB unit shard takes 1 GiB: +35 % of a 405B base per node), and torch's setting that stops the rounding
    above a threshold lets its free lists hand a freed block to a later, larger request of the same power-of-two
    class. So these pages are mapped here and page-locked in place (cudaHostRegister), unlocked and
    unmapped when the last tensor on them dies: its owner drops it only when no copy from or to it is queued.
    Elsewhere a plain host tensor; the simulated GPU books it at its exact size, outside the cached pool."""
    if device.type == "cuda":
        return _registered(numel, dtype)
    return _host_buffer(numel, dtype, device, zero, "exact")


def make_host_buffer(numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    """The allocation behind `host_empty` (`plan --simulate` swaps in its simulated host, plan/simulate.py)."""
    pin = device.type == "cuda"
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device="cpu", pin_memory=pin)


def _host_buffer(numel: int, dtype: torch.dtype, device: torch.device, zero: bool, kind: str) -> torch.Tensor:
    if not is_simulated(device):
        return make_host_buffer(numel, dtype, device, zero=zero)
    return simulated_pinned_buffer(lambda: make_host_buffer(numel, dtype, device, zero=zero), kind)


def simulated_pinned_buffer(make: Callable[[], torch.Tensor], kind: str) -> torch.Tensor:
    """Simulated GPU: the host buffer `make()` returns, booked as pinned of `kind` ("cached" or "exact")."""
    _PINNING.kind = kind  # the allocator model sees the storage while it is made (simulated/allocator.py)
    try:
        t = make()
    finally:
        _PINNING.kind = None
    _sim_pin(t, kind)
    return t


def pinned_kind(storage: Any) -> str | None:
    """Simulated GPU: how a host storage is pinned. "cached": made by `host_empty` (the caching host allocator's
    power-of-two blocks); "exact": by `host_resident`; None: pageable (AdamW's moments, host sums)."""
    kind = getattr(_PINNING, "kind", None)
    if kind is not None:
        return kind
    entry = _SIM_KINDS.get(id(storage))
    return entry[1] if entry is not None and entry[0]() is storage else None


class _LockedPages(mmap.mmap):
    """Anonymous host pages (zero-filled), page-locked for CUDA from registration until this object dies: the
    tensors `torch.frombuffer` makes over it keep it alive, so the pages are unlocked (here) before they are
    unmapped (mmap's own deallocation, after this)."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            with contextlib.suppress(Exception):  # interpreter teardown: the runtime may be gone, and the pages too
                torch.cuda.cudart().cudaHostUnregister(self.address)


def _registered(numel: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = numel * torch.empty((), dtype=dtype, device="meta").element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    pages = _LockedPages(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # holds `pages`; page-aligned
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(raw.data_ptr(), raw.numel(), 0)  # cudaHostRegisterDefault
    if int(err) != 0:
        raise RuntimeError(f"page-locking {raw.numel()} bytes of host memory failed (cudaHostRegister: "
                           f"{cudart.cudaGetErrorString(err)}); `shardtune plan` gives the host memory offload needs")
    pages.address = raw.data_ptr()
    return raw[:nbytes].view(dtype)


def _sim_pin(t: torch.Tensor, kind: str = "cached") -> None:
    import weakref

    st = t.untyped_storage()
    if st.data_ptr():
        _SIM_PINNED[st.data_ptr()] = weakref.ref(st)
    key = id(st)
    _SIM_KINDS[key] = (weakref.ref(st, lambda _: _SIM_KINDS.pop(key, None)), kind)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on `device` without blocking the CPU: staged through a pinned copy (host work only),
    then copied non-blocking. CUDA's caching host allocator keeps the pinned block until the copy has run."""
    if not is_accelerator(device):
        return tensor.to(device)
    if device.type == "cuda":
        staged = tensor.pin_memory()
    else:
        staged = tensor.clone()
        _sim_pin(staged)
    return staged.to(device, non_blocking=True)


def copy_to_device(src: torch.Tensor, device: torch.device, *, out: torch.Tensor | None = None, copy: bool = False,
                   label: str = "") -> tuple[torch.Tensor, Any]:
    """`src`, a host buffer pinned on an accelerator (`host_resident`, `host_empty`), on `device` without blocking
    the CPU: copied on the current stream into `out` when given, else into a new tensor allocated on the current
    stream (`src` itself when it is on `device` already and not `copy`: nothing copied). Returns the device tensor
    and the event recorded on the current stream right after the copy; None on the host (the copy ran inline) or
    when nothing was copied. The device reads `src` only when the stream gets there: the host must not write `src`
    before the event (`host_wait`), nor another stream read the result (`stream.wait_event`). Simulated: the copy
    is recorded as an "h2d" op on the current stream, `label` naming what was copied."""
    if out is None:
        out = src.to(device, non_blocking=True, copy=copy)  # plan --simulate's host tensors take this `.to`
        if out is src:
            return out, None
    else:
        out.copy_(src, non_blocking=True)
    if not is_accelerator(device):
        return out, None
    note(device, "h2d", label)
    done = new_event(device)
    done.record()
    return out, done


def host_wait(event: Any) -> None:
    """Block the CPU until the device has passed `event` (CUDA: a host sync; simulated: TRACE's "host_wait").
    None: nothing queued, nothing to wait for."""
    if event is not None:
        event.synchronize()


def simulated_pinned(t: torch.Tensor) -> bool:
    """Simulated GPU: whether host tensor `t` lies in a buffer `host_empty` / `host_resident` made (what
    `Tensor.is_pinned()` reports under simulation, simulated/device.py)."""
    if t.device.type != "cpu":
        return False
    st = t.untyped_storage()
    ref = _SIM_PINNED.get(st.data_ptr())
    return ref is not None and ref() is not None and st.nbytes() > 0


# -- optimizer -------------------------------------------------------------------------------------------------------
def optimizer_flags(params: list[torch.Tensor]) -> dict[str, bool]:
    """Every state on the host (a CPU run, offloaded shards): the fused CPU kernel, one pass per tensor. Otherwise
    the multi-tensor (foreach) path, torch's default on CUDA; and no fused kernel on a mix of devices."""
    if params and all(p.device.type == "cpu" for p in params):
        return {"fused": True}
    if params and all(_on_simulated_host(p) for p in params):
        # FSDP2's offloaded shards on the simulated GPU: a host kernel that takes meta tensors, one tensor at a time
        # (the fused kernel refuses the meta device; foreach's temporaries of every shard are not the fused kernel's)
        return {"foreach": False}
    return {"foreach": True}


def _on_simulated_host(p: torch.Tensor) -> bool:
    """A parameter (FSDP2's: a DTensor) whose values are a simulated pinned host buffer (simulated_pinned_buffer)."""
    from torch.distributed.tensor import DTensor

    local = p.to_local() if isinstance(p, DTensor) else p
    return local.is_meta and pinned_kind(local.untyped_storage()) is not None


def step_tensor(param: torch.Tensor, *, fused: bool, value: torch.Tensor | float = 0.0) -> torch.Tensor:
    """AdamW's step counter for `param` (torch's own placement: the param's device for fused or capturable
    kernels, a CPU scalar otherwise)."""
    device = param.device if fused else torch.device("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32, copy=True)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


# -- math --------------------------------------------------------------------------------------------------------------
def set_matmul_precision(device: torch.device, compute_dtype: torch.dtype) -> None:
    """A run that computes in a narrower dtype than fp32 (engine.mixed_precision=bf16) on an accelerator: its fp32
    matmuls and convolutions run on tensor cores in TF32. What stays fp32 there (peft's LoRA adapters, which it runs
    in their own fp32: `autocast_adapter_dtype`) would otherwise run on the fp32 CUDA cores, ~15x below the bf16
    rate of an H100; TF32's 10-bit mantissa is still finer than bf16's 7. An fp32 run keeps full fp32 (asked for:
    the parity grids compare at 1e-5). The host is left alone: these are cuBLAS's and cuDNN's flags only
    (`torch.set_float32_matmul_precision` would also let oneDNN round fp32 matmuls on the CPU), so CPU numerics
    never change. The simulated GPU takes the CUDA branch (the flags are set in its process too)."""
    if is_accelerator(device) and compute_dtype != torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# -- host reads ------------------------------------------------------------------------------------------------------
def to_host(tensor: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = False) -> torch.Tensor:
    """A blocking copy to the host (a sync point on CUDA); `copy`: a new tensor even when `tensor` is on the host
    already. Simulated: zeros, a meta tensor has no values."""
    if tensor.is_meta:
        host_sync("to_host")
        # CUDA's blocking copy waits for the current stream's work: the allocator model's pending blocks whose
        # recorded streams it passes can then go back to their pools
        done = SimEvent()
        done.record()
        done.synchronize()
        return torch.zeros(tensor.shape, dtype=dtype or tensor.dtype)
    return tensor.to("cpu", dtype, copy=copy)


def host_values(tensor: torch.Tensor) -> torch.Tensor | None:
    """`to_host(tensor)` for a caller that branches on the values themselves (where documents start), or None on
    the simulated GPU: the blocking copy is counted there as on CUDA, but its zeros would steer the branch wrong."""
    host = to_host(tensor)
    return None if tensor.is_meta else host


def item(tensor: torch.Tensor) -> float:
    return to_host(tensor).item()


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (host, pinned on an accelerator) <- src (device), non-blocking: the caller records an event and waits
    on it before reading `dst`. Simulated: nothing to copy."""
    if not src.is_meta:
        dst.copy_(src, non_blocking=True)
