"""The simulated GPU runs ATen's C++ meta kernels where ATen has one (simulated/device.py `_native_meta_kernels`),
not torch's Python ones: same outputs (shape, strides, dtype), a fraction of the time. Checked on a simulated rank,
where the swap is installed (never in this test process)."""
from __future__ import annotations

import torch

from tests.simulated.harness import run_simulated


def _meta_kernel_source(op: torch._ops.OpOverload) -> str:
    """Where the op's Meta kernel was registered; empty when it has none (its C++ composite serves meta)."""
    return next((ln for ln in torch._C._dispatch_dump(op.name()).splitlines() if ln.startswith("Meta:")), "")


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _agree_with_the_python_kernels() -> None:
    aten = torch.ops.aten
    meta = torch._C.DispatchKey.Meta
    a = torch.empty(4, 1, 6, dtype=torch.bfloat16, device="meta")
    b = torch.empty(5, 6, device="meta")
    t = torch.empty(6, 8, device="meta").t()  # a transposed view: elementwise outputs keep its layout
    cases = [(aten.add.Tensor, (a, b)), (aten.mul.Tensor, (t, 2.0)), (aten.neg.default, (t,)),
             (aten.silu.default, (a,)), (aten.empty_like.default, (t,)), (aten.sum.dim_IntList, (b, [1])),
             (aten.mm.default, (b, torch.empty(6, 3, device="meta")))]
    for op, args in cases:
        source = _meta_kernel_source(op)
        assert source == "" or "RegisterMeta" in source, source  # ATen's meta kernel, or its C++ composite
        assert _layout(op(*args)) == _layout(op.py_kernels[meta](*args)), op
    # ops ATen has no meta kernel for keep torch's Python one
    index = torch.empty(3, dtype=torch.long, device="meta")
    source = _meta_kernel_source(aten.index_select.default)
    assert source and "RegisterMeta" not in source, source
    assert tuple(b.index_select(0, index).shape) == (3, 6)


def test_the_simulated_gpu_runs_atens_meta_kernels():
    run_simulated(_agree_with_the_python_kernels, 1)
