import os
from pathlib import Path

import pytest

# Tests run on CPU with gloo; keep each process to one thread so 2-4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

UNIT = Path(__file__).parent / "unit"


# The costliest files first, by the seconds each holds a worker (measured 2026-11-29 under `make test`'s two workers):
# a worker that picks one up last would run it alone while the other idles. SLURM first: most of its time is waiting
# on the cluster, which the other worker fills. The Makefile passes --no-loadscope-reorder, without which xdist hands
# out files by their number of tests instead. Order only; every file keeps its tests together and in order.
COSTLIEST_FIRST = ["slurm/test_slurm_job.py", "integration/test_checkpoint.py", "integration/test_plan_accuracy.py",
                   "simulated/test_matrix.py", "distributed/test_vocab_parallel.py", "integration/test_hub.py",
                   "integration/test_qlora_train.py", "distributed/test_moe.py", "simulated/test_recipe_syncs.py",
                   "integration/test_cli_train.py", "integration/test_malformed_inputs.py",
                   "simulated/test_plan_simulate.py", "distributed/test_parity.py", "integration/test_moe_train.py",
                   "integration/test_dpo_train.py", "integration/test_own_data.py",
                   "integration/test_installed_executable.py", "integration/test_lora_train.py",
                   "distributed/test_dpo.py", "integration/test_generate.py", "distributed/test_lora.py",
                   "integration/test_cli_usage.py"]


def _cost_rank(item) -> int:
    path = Path(item.fspath).as_posix()
    return next((i for i, name in enumerate(COSTLIEST_FIRST) if path.endswith("tests/" + name)), len(COSTLIEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_cost_rank)  # stable: the rest stays in collection order
    # Two tiers by cost: tests/unit runs in this process only (seconds in all, `make test-fast`); every other
    # directory starts processes (ranks, the CLI, a SLURM cluster) and is `slow`. `make test` runs both.
    for item in items:
        if UNIT not in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
