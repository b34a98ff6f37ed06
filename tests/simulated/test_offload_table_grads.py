"""cpu_offload: a row-sharded vocabulary table's gradient reaches the host without a host synchronization
(offload_table_grads.py, on the simulated GPU's record)."""
from __future__ import annotations

from tests.simulated import offload_table_grads
from tests.simulated.harness import run_simulated


def test_table_gradients_copied_without_blocking():
    run_simulated(offload_table_grads.run_checks, 2, [{"names": ["table_gradients_copied_without_blocking"]}])


def test_hybrid_table_gradients_reduced_without_blocking():
    run_simulated(offload_table_grads.run_checks, 4, [{"names": ["hybrid_table_gradients_reduced_without_blocking"]}])
