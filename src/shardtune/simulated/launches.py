"""Kernel launches of a simulated step, counted as a GPU would be asked to run them (`plan --simulate`), with the
FLOPs and bytes those kernels move: what the roofline (plan/roofline.py) turns into time.

What one launch is here:
  - each ATen op dispatched below autograd (so backward's ops are seen, and a composite op as the ops it decomposes
    into) with a tensor on the simulated GPU (meta, not a simulated host tensor: simulated/host.py);
  - each collective on the simulated GPU's process group (simulated/process_group.py), one NCCL kernel, and each
    functional collective (`_c10d_functional`, DTensor's), its `wait_tensor` not.
  Not counted: views and aliases (an op whose schema returns an alias of an input: `view`, `t`, `expand`, `detach`,
  `as_strided`, and `_unsafe_view`, a view in all but its schema): metadata only, no kernel; allocations (`empty`,
  `empty_strided`, `empty_like`, `new_empty*`, storage `resize_`, `set_`, `record_stream`): the caching allocator,
  no kernel; host reads (`_local_scalar_dense`): host syncs, counted apart (accelerator.host_syncs); ops on simulated
  host tensors (the host AdamW of an offloaded run): host CPU time, not GPU launches.
  So a fused kernel counts one (torch's `rms_norm`, SDPA, a `_foreach_*` call, `AdamW(fused=True)`), as do ops CUDA
  runs as two or three kernels (SDPA's backward, a split-K GEMM): the count is of what the host issues, the figure
  a host-bound step scales with.

Phases: backward when the autograd engine runs (a graph task is current) with grad mode off; recompute when it runs
with grad mode on (checkpointed units' forward again, a chunked module's re-run in its own backward); forward
outside it before each micro-step's backward; optimizer after the last micro-step's backward (clipping, the
step's read, AdamW, zero_grad, the next step's batch copies); communication: the collectives, wherever they run.

Each is kept per micro-step (`micro`: 0, 1, ... in order; the last bucket is after the last backward), so a step
run with fewer micro-steps than the recipe's grad_accum scales to it (`per_step`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from shardtune.simulated import process_group
from shardtune.simulated.host import HostMeta, is_host

PHASES = ("forward", "recompute", "backward", "optimizer", "communication")
# Allocations and metadata: no kernel runs (names of the op packets).
_NOT_KERNELS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_",
                          "set_", "record_stream", "_unsafe_view", "lift_fresh", "_local_scalar_dense",
                          "is_pinned", "_has_same_storage_numel", "is_same_size"})
_FUNCTIONAL_WAIT = "wait_tensor"


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """`aten._grouped_mm` (MoE experts), which torch's FLOP counter leaves out: 2 x output x contraction. A 2-D x
    2-D call (the experts' weight gradient, groups along the contraction) has each group's output over its share
    of the contraction: 2 x one group's output x the whole contraction."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * (out.numel() // max(1, out.shape[0])) * a.shape[-1]
    return 2 * out.numel() * a.shape[-1]


class LaunchCounter(TorchDispatchMode):
    """Counts launches, FLOPs and bytes of the ops the simulated GPU runs (module docstring), per micro-step and
    phase, over one training step of `micro_steps` micro-steps. Use as a context manager around the step."""

    def __init__(self, micro_steps: int) -> None:
        super().__init__()
        self.micro_steps = micro_steps
        # (micro bucket, what) -> amount; what: a phase (kernels), "flops_bf16" / "flops_fp32" (matmul and attention
        # FLOPs by input dtype), "device_bytes" (read + written by the kernels), "link_bytes" (this rank's share
        # of its collectives: sent or received)
        self.counts: Counter[tuple[int, str]] = Counter()
        self.micro = 0  # micro-steps whose backward has ended
        self._in_backward = False

    def __enter__(self) -> LaunchCounter:
        process_group.COLLECTIVE_OBSERVERS.append(self._collective)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        process_group.COLLECTIVE_OBSERVERS.remove(self._collective)
        return super().__exit__(*exc)

    def _phase(self) -> str:
        in_backward = torch._C._current_graph_task_id() >= 0
        if self._in_backward and not in_backward:
            self.micro += 1  # that micro-step's backward has ended
        self._in_backward = in_backward
        if in_backward:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward" if self.micro < self.micro_steps else "optimizer"

    def _collective(self, op: str, link_bytes: int) -> None:
        self._phase()  # a collective may be the first op after a backward
        self.counts[self.micro, "communication"] += 1
        self.counts[self.micro, "link_bytes"] += link_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = packet.__name__
        if func.is_view or name in _NOT_KERNELS or is_host(None):
            return out
        if func.namespace == "_c10d_functional":
            if name != _FUNCTIONAL_WAIT:
                self._collective(name, 0)
            return out
        flat, _ = tree_flatten((args, kwargs, out))
        # each input read once and each output written once (in place: the same tensor read and written)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not any(t.is_meta and not isinstance(t, HostMeta) for t in tensors):
            return out
        phase = self._phase()
        self.counts[self.micro, phase] += 1
        self.counts[self.micro, "device_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        count = flop_registry.get(packet)
        if count is not None or name == "_grouped_mm":
            flops = count(*args, **kwargs, out_val=out) if count is not None else \
                _grouped_mm_flops(args[0], args[1], out)
            fp32 = isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32
            self.counts[self.micro, "flops_fp32" if fp32 else "flops_bf16"] += int(flops)
        return out

    def per_step(self, grad_accum: int) -> dict[str, Any]:
        """The figures of one optimizer step of `grad_accum` micro-steps. When the counted step ran fewer, its first
        micro-step (one without the last one's gradient sync) stands for each one not run."""
        assert grad_accum >= self.micro_steps, (grad_accum, self.micro_steps)
        total: Counter[str] = Counter()
        for (micro, what), n in self.counts.items():
            total[what] += n * (1 + grad_accum - self.micro_steps if micro == 0 else 1)
        by_phase = {p: total[p] for p in PHASES}
        return {"total": sum(by_phase.values()), "by_phase": by_phase,
                "counted": sum(n for (_, what), n in self.counts.items() if what in PHASES),
                "flops_bf16": total["flops_bf16"], "flops_fp32": total["flops_fp32"],
                "device_bytes": total["device_bytes"], "link_bytes": total["link_bytes"]}
