"""Peak live tensor bytes: a CPU tracker (what `train.profile_memory` measures and `plan` predicts); CUDA reads the
allocator.

CPU method (no allocator hooks exist on CPU, and we do not monkeypatch torch): a `TorchDispatchMode` sees every op's
outputs; each new untyped storage is registered once, keyed by its data pointer, with a `weakref` whose callback
subtracts its bytes when the storage dies. Storages alive before `start()` are found once by scanning the garbage
collector's tensors. Storages resized in place outside dispatch (`UntypedStorage.resize_`, how FSDP frees gathered
parameters) are caught by `storage_resized()`, which our engine calls when it resizes, and, for code that does not
(FSDP2), by re-reading the size of every registered storage of at least `recheck_min_bytes` after each op. Cost:
Python work per op (~2-5x slower steps): use it for measurement runs, not for timing.

Meta mode (`device_type="meta"`, what `plan --simulate` uses): the same bookkeeping over meta storages, which have
sizes but no bytes, so a full-size step on the simulated GPU reports the device peak it would reach. `host` (a
predicate: "is a storage created now, or this tensor, host memory?") splits off what the simulation keeps on its
stand-in host, counted apart in `host_peak_bytes()`.
"""
from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE: list[CpuMemoryTracker] = []
RECHECK_MIN_BYTES = 64 * 1024  # storages this big are re-read after every op unless resizes are reported
_HOST_SCOPE = threading.local()  # depth of `host_allocations()` blocks open in this thread


@contextmanager
def host_allocations() -> Iterator[None]:
    """Storages created inside count as host memory (apart from the device peak), on any device type: what a CPU run
    offloads to "host" buffers (engine/offload_activations.py) would sit in pinned host memory on an accelerator."""
    _HOST_SCOPE.depth = getattr(_HOST_SCOPE, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST_SCOPE.depth -= 1


def storage_resized(tensor: torch.Tensor) -> None:
    """Called by code that resizes a storage in place; updates the active tracker (no-op when none)."""
    for t in _ACTIVE:
        t._update(_data_storage(tensor))


def free_storage(tensor: torch.Tensor) -> None:
    """Free `tensor`'s bytes now, whoever else still references it (autograd's saved views, a gloo work that its
    worker thread drops only after `wait()` returned): the storage is resized to 0, the tensor object stays."""
    tensor.untyped_storage().resize_(0)
    storage_resized(tensor)


def _each_tensor(x: object, visit: Callable[[torch.Tensor], None]) -> None:
    """`visit` every tensor in an op's arguments or outputs: tensors, in tuples and lists (torch's pytree finds the
    same ones in an aten op's arguments, at several times the cost: this runs for every op of a tracked step)."""
    if isinstance(x, torch.Tensor):
        visit(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _each_tensor(y, visit)


def _data_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage that owns `t`'s bytes, or None for a wrapper subclass (DTensor): it reports its logical size
    but holds no data (its local tensor, seen separately, does). A meta storage never has a data pointer: there a
    wrapper is told by its own __torch_dispatch__."""
    try:
        if t.is_meta:
            return None if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ else t.untyped_storage()
        st = t.untyped_storage()
        if st.data_ptr() == 0 and st.nbytes() > 0:
            return None
        return st
    except (RuntimeError, NotImplementedError):
        return None


class CpuMemoryTracker(TorchDispatchMode):
    def __init__(self, *, recheck_min_bytes: int = RECHECK_MIN_BYTES, device_type: str = "cpu",
                 host: Callable[[torch.Tensor | None], bool] | None = None, record_peak: bool = False) -> None:
        """`device_type`: whose storages count (cpu, or meta for the simulated GPU). `host(t)`: whether tensor
        `t` (at start) or an op's output now (`t` None) is host memory, counted apart (meta mode only).
        `record_peak`: keep the list of live storages at the peak (`peak_live`), each labelled with the op, shape
        and dtype of the tensor that created it; a diagnostic (O(live storages) per new peak)."""
        super().__init__()
        self.recheck_min_bytes = recheck_min_bytes
        self.record_peak = record_peak
        self._labels: dict[int, str] = {}
        self._op = "before start"
        self.peak_live: list[tuple[str, int]] = []  # (label, bytes) of each live storage at the peak
        self.device_type = device_type
        self._host_pred = host
        self._host: set[int] = set()  # keys of host storages
        self._host_live = 0
        self._host_peak = 0
        self._sizes: dict[int, int] = {}  # id(storage wrapper) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._big: set[int] = set()  # ids rechecked after every op
        self._live = 0
        self._peak = 0
        self.peak_op = ""
        self._lock = threading.RLock()  # re-entrant: gc may run a weakref callback while we hold it

    # -- registration ----------------------------------------------------------------------------------------------
    def _update(self, st: torch.UntypedStorage | None, host: bool | None = None, label: str = "") -> None:
        if st is None or st.device.type != self.device_type:
            return
        with self._lock:
            if self.record_peak and id(st) not in self._labels:
                self._labels[id(st)] = label or self._op
            self._update_locked(st, host)

    def _update_locked(self, st: torch.UntypedStorage, host: bool | None = None) -> None:
        key = id(st)
        n = st.nbytes()
        if key not in self._sizes:
            self._refs[key] = weakref.ref(st, lambda _, k=key: self._forget(k))
            self._sizes[key] = 0
            if host if host is not None else (getattr(_HOST_SCOPE, "depth", 0) > 0
                                              or (self._host_pred is not None and self._host_pred(None))):
                self._host.add(key)
        old = self._sizes[key]
        if n != old:
            self._sizes[key] = n
            self._add(key, n - old)
            if n >= self.recheck_min_bytes:
                self._big.add(key)

    def _add(self, key: int, delta: int) -> None:
        if key in self._host:
            self._host_live += delta
            self._host_peak = max(self._host_peak, self._host_live)
        else:
            self._live += delta
            if self._live > self._peak and self.record_peak:
                self.peak_live = [(self._labels.get(k, "?"), b) for k, b in self._sizes.items()
                                  if b and k not in self._host]
            self._peak = max(self._peak, self._live)

    def _forget(self, key: int) -> None:
        # Weakref callbacks run in whichever thread drops the last reference (autograd, gloo): hence the lock.
        with self._lock:
            self._add(key, -self._sizes.pop(key, 0))
            self._host.discard(key)
            self._refs.pop(key, None)
            self._big.discard(key)
            self._labels.pop(key, None)

    def _recheck_big(self) -> None:
        with self._lock:
            for key in list(self._big):
                ref = self._refs.get(key)
                st = ref() if ref is not None else None
                if st is not None and key in self._sizes and st.nbytes() != self._sizes[key]:
                    delta = st.nbytes() - self._sizes[key]
                    self._sizes[key] = st.nbytes()  # before _add: a subclass reads the new size there
                    self._add(key, delta)

    def _update_tensor(self, t: torch.Tensor) -> None:
        st = _data_storage(t)
        if st is not None:
            if self._sizes.get(id(st)) == st.nbytes():
                return  # registered, same size: what _update would conclude, without its checks (most inputs)
            # a host tensor an op returned as such (the simulated GPU's copy to the host, simulated/device.py), else
            # the op's context decides
            host = True if self._host_pred is not None and self._host_pred(t) else None
            self._update(st, host, label=f"{self._op} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                         if self.record_peak else "")
        elif hasattr(t, "__tensor_flatten__"):
            # A wrapper subclass (DTensor, FSDP2's parameters, grads and AdamW state) runs its ops on its inner
            # tensors inside its own __torch_dispatch__, where this mode is not active: count what it holds
            # here, or a tracker started before the first step would never see FSDP2's optimizer state.
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    self._update_tensor(inner)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        peak_before = self._peak
        out = func(*args, **(kwargs or {}))
        if self.record_peak:  # the op's name labels the storages it creates: only --peak-list reads them
            self._op = str(func)
        _each_tensor(out, self._update_tensor)
        _each_tensor(args, self._update_tensor)  # in-place ops (resize_, set_) may grow an input's storage
        self._recheck_big()
        if self._peak > peak_before:
            self.peak_op = str(func)  # the op at which the peak was reached: the first clue when profiling
        return out

    # -- public API ------------------------------------------------------------------------------------------------
    def start(self) -> CpuMemoryTracker:
        gc.collect()
        meta = self.device_type == "meta"
        found = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # type(): no __class__
        if self._host_pred is not None:  # host tensors first: a storage is host if any tensor on it is
            found.sort(key=lambda t: not self._host_pred(t))
        for obj in found:
            if obj.is_meta == meta:
                self._update(_data_storage(obj), host=self._host_pred is not None and self._host_pred(obj),
                             label=f"before start {tuple(obj.shape)}" if self.record_peak else "")
        self._peak, self._host_peak = self._live, self._host_live
        _ACTIVE.append(self)
        self.__enter__()
        return self

    def stop(self) -> None:
        self.__exit__(None, None, None)
        _ACTIVE.remove(self)

    def reset_peak(self) -> None:
        self._recheck_big()
        self._peak, self._host_peak = self._live, self._host_live

    def peak_bytes(self) -> int:
        return self._peak

    def host_peak_bytes(self) -> int:
        return self._host_peak

    def live_bytes(self) -> int:
        self._recheck_big()
        return self._live


class CudaMemoryTracker:
    """Same API over the CUDA caching allocator's counters (exact, free)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> CudaMemoryTracker:
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def stop(self) -> None:
        pass

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)


def recheck_min_bytes(resizes_reported: bool) -> int:
    """The CPU tracker's `recheck_min_bytes`. `resizes_reported`: every in-place storage resize of the run calls
    `storage_resized` (our engine's do), so no per-op recheck of big storages (a sixth of a tracked step's time);
    FSDP2's resizes report nothing."""
    return sys.maxsize if resizes_reported else RECHECK_MIN_BYTES


def memory_tracker(device: torch.device, *, resizes_reported: bool = False) -> CpuMemoryTracker | CudaMemoryTracker:
    """The tracker for `device`; call `.start()` before the steps to measure and `.stop()` after."""
    if device.type == "cuda":
        return CudaMemoryTracker(device)
    return CpuMemoryTracker(recheck_min_bytes=recheck_min_bytes(resizes_reported))


def snapshot_live_bytes() -> int:
    """Bytes of all CPU tensor storages alive now (gc scan; exact but O(objects): for tests and checkpoints)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and obj.device.type == "cpu":
            st = _data_storage(obj)
            if st is not None:
                seen[id(st)] = st.nbytes()
    return sum(seen.values())
