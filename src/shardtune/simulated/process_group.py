"""The simulated GPU's process group: NCCL's refusals, and every collective matched across ranks in order.

A Python `ProcessGroup` (torch's plugin seam, `dist.Backend.register_backend(..., devices=["meta"])`) runs each
collective at once and moves nothing (meta tensors hold no bytes). Before it returns, two checks:

  1. What NCCL refuses, refused here with the op and the call site: a tensor not on the device (NCCL's own words,
     "No backend type associated with device type cpu"), a non-contiguous tensor, an input and output of different
     dtypes, an output of the wrong size (all-gather: world x input; reduce-scatter: input = world x output).
  2. The ranks agree: each rank writes the collective's fingerprint (op, group, shapes, dtypes, devices, reduce op,
     root) under its sequence number in the group's store, then reads every peer's. A different fingerprint raises
     `CollectiveMismatch` on every rank, naming each rank's op and call site; a peer that never arrives (it skipped
     the collective, or took another path) raises it after `check_timeout_s` on the ranks that did arrive.

Why not torch's `ProcessGroupWrapper` (what `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps groups with): it needs a
backend with sequence numbers (FakeProcessGroup has none: "Backend fake does not yet support sequence numbers"),
it is switched on by an environment variable for every group at once (the gloo host group too), it names the
sequence number but not the Python call site, and it checks neither contiguity nor output sizes.

Cost: one store write and one read of every peer's key per collective (a rendezvous: ranks run in lock step at
each collective). Left unchecked: functional collectives (`torch.distributed._functional_collectives`, DTensor's
`full_tensor`) on meta tensors run torch's shape-only meta kernel and never reach a process group.

`plan --simulate` runs rank 0 alone for the whole world (`standing_in_for_world`): the NCCL rules still hold, the
cross-rank match is skipped (there are no peers).
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

DEVICE_TYPE = "meta"


class CollectiveMismatch(RuntimeError):
    """Ranks disagree on a collective (op, group, shape, dtype or device), or one never entered it."""


class RefusedTensor(RuntimeError):
    """A tensor NCCL would refuse."""


_SETTINGS = {"check_timeout_s": 60.0, "alone": False}
_EPOCH = [0]  # bumped by new_epoch(): every group's sequence numbers start again
# Called with (op, link bytes) for each collective issued: this rank's bytes sent or received over the link, as a
# ring moves them. What simulated/launches.py counts as the step's communication launches.
COLLECTIVE_OBSERVERS: list = []


def new_epoch() -> None:
    """Start every group's sequence over, on every rank at the same point (after a host barrier): a test that
    runs several settings in one start keeps checking after a setting that failed part-way through."""
    _EPOCH[0] += 1


def set_check_timeout(seconds: float) -> None:
    """How long a rank waits for its peers at a collective before it reports the ones that never came."""
    _SETTINGS["check_timeout_s"] = seconds


@contextlib.contextmanager
def standing_in_for_world() -> Iterator[None]:
    """Groups created inside are rank 0 alone standing in for the world: no peer to match against."""
    _SETTINGS["alone"] = True
    try:
        yield
    finally:
        _SETTINGS["alone"] = False


def create_group(common_opts: Any, backend_opts: Any) -> CheckedGroup:
    """The creator `dist.Backend.register_backend` calls (extended API) for each group on the simulated GPU."""
    return CheckedGroup(common_opts.store, common_opts.group_rank, common_opts.group_size,
                        name=common_opts.group_id, global_ranks=list(common_opts.global_ranks_in_group),
                        alone=_SETTINGS["alone"])


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def call_site(depth: int = 2) -> str:
    """The first `depth` frames outside torch and this module: where the product issued the collective."""
    frames: list[str] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < depth:
        path = f.f_code.co_filename
        if "/torch/" not in path and not path.endswith("simulated/process_group.py"):
            short = path.split("/src/", 1)[-1] if "/src/" in path else "/".join(path.rsplit("/", 3)[-3:])
            frames.append(f"{short}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(frames) or "?"


def _reduce_op(opts: Any) -> str:
    op = getattr(opts, "reduceOp", None)
    return str(getattr(op, "op", op))  # RedOpType.SUM; the ReduceOp wrapper itself prints its address


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def _describe(t: torch.Tensor) -> list:
    return [list(t.shape), str(t.dtype).removeprefix("torch."), t.device.type]


class CheckedGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, *, name: str, global_ranks: list[int],
                 alone: bool) -> None:
        super().__init__(rank, size)
        self._store, self._rank, self._size = store, rank, size
        self._name, self._global_ranks, self._alone = name, global_ranks or list(range(size)), alone
        self._seq, self._epoch = 0, _EPOCH[0]

    # -- identity (what dist and the functional collectives read) ----------------------------------------------------
    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return "simgpu"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"CheckedGroup({self._name}, rank {self._rank} of {self._global_ranks})"

    # -- the checks ------------------------------------------------------------------------------------------------
    def _refuse(self, op: str, site: str, why: str) -> None:
        raise RefusedTensor(f"simulated GPU: {op} on group {self._name} at {site}: {why}")

    def _on_device(self, op: str, site: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != DEVICE_TYPE:  # NCCL's own words, so a message reads the same on the first GPU run
                self._refuse(op, site, f"No backend type associated with device type {t.device.type}")
            if not t.is_contiguous():
                self._refuse(op, site, f"Tensors must be contiguous (got shape {tuple(t.shape)}, "
                                       f"strides {t.stride()})")

    def _same_dtype(self, op: str, site: str, tensors: Sequence[torch.Tensor]) -> None:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            self._refuse(op, site, f"input and output dtypes differ: {sorted(map(str, dtypes))}")

    def _match(self, op: str, site: str, tensors: Sequence[torch.Tensor], **extra: Any) -> None:
        """Rendezvous through the group's store: every rank's fingerprint for this sequence number must agree."""
        if self._epoch != _EPOCH[0]:
            self._epoch, self._seq = _EPOCH[0], 0
        seq, self._seq = self._seq, self._seq + 1
        if self._alone or self._size == 1:
            return
        mine = json.loads(json.dumps({"op": op, "group": [self._name, self._global_ranks],
                                      "tensors": [_describe(t) for t in tensors], **extra}))  # as peers read it
        prefix = f"simgpu-check/{self._epoch}/{seq}/"
        self._store.set(prefix + str(self._rank), json.dumps({**mine, "site": site}))
        keys = [prefix + str(r) for r in range(self._size)]
        timeout = _SETTINGS["check_timeout_s"]
        try:
            self._store.wait(keys, timedelta(seconds=timeout))
        except (RuntimeError, dist.DistStoreError) as e:
            missing = [self._global_ranks[r] for r, k in enumerate(keys) if not self._store.check([k])]
            raise CollectiveMismatch(
                f"simulated GPU: rank {self._global_ranks[self._rank]} entered {op} #{seq} on group {self._name} "
                f"(ranks {self._global_ranks}) at {site}; rank(s) {missing} did not enter it within {timeout:g} s "
                "(a rank skipped this collective or issued it on another path)") from e
        theirs = [json.loads(v) for v in self._store.multi_get(keys)]
        if any({k: v for k, v in t.items() if k != "site"} != mine for t in theirs):
            lines = "; ".join(f"rank {self._global_ranks[r]}: {t['op']} {t['tensors']} at {t['site']}"
                              for r, t in enumerate(theirs))
            raise CollectiveMismatch(f"simulated GPU: collective #{seq} on group {self._name} differs across "
                                     f"ranks (op, shape, dtype or device): {lines}")

    def _checked(self, op: str, tensors: Sequence[torch.Tensor], *, full: int = 0, **extra: Any) -> str:
        """`full`: the bytes of the whole buffer (all-gather's output, reduce-scatter's input, all-reduce's tensors)."""
        site = call_site()
        self._on_device(op, site, tensors)
        self._match(op, site, tensors, **extra)
        self._observe(op, full)
        return site

    def _observe(self, op: str, full: int) -> None:
        """Tell the observers; ring collectives move (size - 1) / size of the buffer per rank, all-reduce twice
        (a reduce-scatter and an all-gather), broadcast the buffer once."""
        if not COLLECTIVE_OBSERVERS:
            return
        share = (self._size - 1) / self._size if self._size > 1 else 0.0
        moved = int(full * share * (2 if op.startswith("all_reduce") else 1)) if op != "broadcast" else full
        for observe in COLLECTIVE_OBSERVERS:
            observe(op, moved if self._size > 1 else 0)

    # -- the collectives ---------------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._checked("all_reduce", tensors, full=_nbytes(tensors), reduce_op=_reduce_op(opts))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._checked("all_reduce_coalesced", tensors, full=_nbytes(tensors), reduce_op=_reduce_op(opts))
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._checked("broadcast", tensors, full=_nbytes(tensors), root=getattr(opts, "rootRank", 0))
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        self._checked("barrier", [])
        return _done(None)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        site = self._checked("all_gather_into_tensor", [output, input], full=output.nbytes)
        self._same_dtype("all_gather_into_tensor", site, [output, input])
        if output.numel() != input.numel() * self._size:
            self._refuse("all_gather_into_tensor", site, f"output numel {output.numel()} != {self._size} ranks x "
                                                         f"input numel {input.numel()}")
        return _done(output)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        site = self._checked("reduce_scatter_tensor", [output, input], full=input.nbytes, reduce_op=_reduce_op(opts))
        self._same_dtype("reduce_scatter_tensor", site, [output, input])
        if input.numel() != output.numel() * self._size:
            self._refuse("reduce_scatter_tensor", site, f"input numel {input.numel()} != {self._size} ranks x "
                                                        f"output numel {output.numel()}")
        return _done(output)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._one_per_rank("all_gather", inputs, outputs, "outputs", full=sum(map(_nbytes, outputs)))
        return _done(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        self._one_per_rank("reduce_scatter", outputs, inputs, "inputs", full=sum(map(_nbytes, inputs)))
        return _done(outputs)

    def _one_per_rank(self, op: str, singles: list[torch.Tensor], lists: list[list[torch.Tensor]], what: str, *,
                      full: int) -> None:
        """The list forms: each of `singles` pairs with a list of one tensor per rank, each of its numel."""
        flat = [t for lst in lists for t in lst]
        site = self._checked(op, [*singles, *flat], full=full)
        self._same_dtype(op, site, [*singles, *flat])
        for one, lst in zip(singles, lists, strict=True):
            if len(lst) != self._size or any(t.numel() != one.numel() for t in lst):
                self._refuse(op, site, f"needs {self._size} {what} of numel {one.numel()}, got "
                                       f"{[t.numel() for t in lst]}")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> Any:
        # Uneven splits differ across ranks by design: the match compares what must agree (op, dtype, device, the
        # row width), and this rank's own split sums against its buffers.
        site = call_site()
        self._on_device("all_to_all_single", site, [output, input])
        self._same_dtype("all_to_all_single", site, [output, input])
        for name, t, splits in (("output", output, output_splits), ("input", input, input_splits)):
            rows = t.shape[0] if t.dim() else 0
            if (sum(splits) if splits else rows) != rows or (not splits and rows % self._size):
                self._refuse("all_to_all_single", site, f"{name} splits {splits} do not cover its {rows} rows "
                                                        f"over {self._size} ranks")
        self._match("all_to_all_single", site, [], row=[list(input.shape[1:]), str(input.dtype), "meta"])
        self._observe("all_to_all_single", input.nbytes)
        return _done(output)
