import os
from pathlib import Path

import pytest

# Tests run on CPU with gloo; keep each process to one thread so 2-4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

UNIT = Path(__file__).parent / "unit"


# The costliest files first (seconds under `make test`'s two workers, measured 2026-11-27): a worker that picks one
# up last would run it alone while the other idles. Order only; every file keeps its tests together and in order.
COSTLIEST_FIRST = ["slurm/test_slurm_job.py", "integration/test_plan_accuracy.py", "integration/test_checkpoint.py",
                   "simulated/test_moe_plan_simulate.py", "simulated/test_matrix.py", "integration/test_qlora_train.py",
                   "integration/test_malformed_inputs.py", "simulated/test_plan_simulate.py",
                   "integration/test_own_data.py", "distributed/test_vocab_parallel.py",
                   "integration/test_moe_train.py", "distributed/test_parity.py"]


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
