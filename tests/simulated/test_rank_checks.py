"""The simulated GPU's process group (shardtune/simulated/process_group.py) catches what a GPU run would hang or
crash on: a skipped collective, ranks disagreeing on op or shape, and tensors NCCL refuses (rank_checks.py)."""
from __future__ import annotations

from tests.simulated import rank_checks
from tests.simulated.harness import run_simulated


def test_collectives_are_checked_across_ranks():
    run_simulated(rank_checks.run_cases, 2)
