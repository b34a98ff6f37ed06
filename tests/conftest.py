import os
from pathlib import Path

import pytest

# Tests run on CPU with gloo; keep each process to one thread so 2-4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(config, items):
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
