"""Finding 7 (issue 20): torchrun gives each of several workers OMP_NUM_THREADS=1; the launcher must lift that for
GPU runs too when the host does real work (cpu_offload: host AdamW, gradient adds, norms), and always honour
launch.threads_per_worker."""
from __future__ import annotations

import os

import pytest

from shardtune.config.load import load_recipe
from shardtune.launcher.launch import worker_threads

CORES = os.cpu_count() or 2


@pytest.mark.parametrize(("overrides", "nproc", "expected"), [
    (["launch.device=cuda", "engine.cpu_offload=true"], 2, max(1, CORES // 2)),
    (["launch.device=cuda", "engine.cpu_offload=true", "launch.threads_per_worker=3"], 2, 3),
    (["launch.device=cuda", "engine.cpu_offload=false", "launch.threads_per_worker=5"], 4, 5),
    (["launch.device=cuda", "engine.cpu_offload=false"], 2, None),  # torchrun's default stays
    (["launch.device=cpu", "engine.cpu_offload=false"], 1, CORES),
    (["launch.device=cpu", "launch.threads_per_worker=2"], 2, 2),
])
def test_worker_threads(overrides: list[str], nproc: int, expected: int | None,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite exports 1 (conftest.py)
    assert worker_threads(load_recipe("recipes/tiny-lora-cpu.yaml", overrides), nproc) == expected


@pytest.mark.parametrize(("exported", "overrides", "expected"), [
    ("1", ["launch.device=cpu"], 1),  # a machine shared with other jobs: the user's export wins over the share
    ("3", ["launch.device=cuda", "engine.cpu_offload=false"], 3),
    ("3", ["launch.device=cpu", "launch.threads_per_worker=2"], 2),  # the recipe's key wins over the export
    ("", ["launch.device=cpu"], CORES), ("zero", ["launch.device=cpu"], CORES), ("0", ["launch.device=cpu"], CORES),
])
def test_an_exported_omp_num_threads_is_honoured(exported: str, overrides: list[str], expected: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", exported)
    assert worker_threads(load_recipe("recipes/tiny-lora-cpu.yaml", overrides), 1) == expected


def test_threads_reach_torch_on_a_gpu_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the worker, launch.threads_per_worker sets torch's pool whatever the device (not only on CPU)."""
    import torch

    from shardtune.trainer import runtime

    recipe = load_recipe("recipes/tiny-lora-cpu.yaml", ["launch.threads_per_worker=3"])
    monkeypatch.setattr(runtime.accelerator, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # init_runtime fills them when unset: keep the env as it was
    monkeypatch.setenv("MASTER_PORT", "29500")
    before = torch.get_num_threads()
    try:
        runtime.init_runtime(recipe.launch, simulated=True)  # the simulated GPU: a non-CPU device
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
