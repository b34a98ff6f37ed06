"""Issue 58 defect 3: a bf16 run's fp32 matmuls (peft's adapters run in fp32) take TF32 on a GPU, set by the device
seam when the runtime starts; the simulated GPU takes that CUDA branch, and the host's fp32 numerics never change."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.trainer import runtime


@pytest.fixture
def flags() -> Iterator[None]:
    """cuBLAS's and cuDNN's TF32 flags off before the test, restored after (they are process-wide)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _start(monkeypatch: pytest.MonkeyPatch, compute_dtype: torch.dtype) -> None:
    """init_runtime on the simulated GPU (a GPU's branches on meta), no process group."""
    monkeypatch.setattr(runtime.accelerator, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    recipe = load_recipe("recipes/tiny-lora-cpu.yaml", [])
    runtime.init_runtime(recipe.launch, simulated=True, compute_dtype=compute_dtype)


def test_a_bf16_run_on_the_gpu_branch_takes_tf32(flags: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(monkeypatch, torch.bfloat16)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_an_fp32_run_keeps_full_fp32(flags: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(monkeypatch, torch.float32)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_the_host_is_left_alone(flags: None) -> None:
    """A CPU run sets nothing; and the flags a GPU run sets change no fp32 product on the host (oneDNN's precision is
    not touched: torch.set_float32_matmul_precision would have)."""
    accelerator.set_matmul_precision(torch.device("cpu"), torch.bfloat16)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 48, generator=g)
    host = torch.backends.mkldnn.matmul.fp32_precision
    before = (a @ b, torch.nn.functional.linear(a, b.t()))
    accelerator.set_matmul_precision(accelerator.SIMULATED, torch.bfloat16)
    assert torch.backends.cuda.matmul.allow_tf32  # the GPU branch ran in this process
    after = (a @ b, torch.nn.functional.linear(a, b.t()))
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert torch.backends.mkldnn.matmul.fp32_precision == host
