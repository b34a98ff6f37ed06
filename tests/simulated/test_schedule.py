"""The stream schedule of issue 20's findings 4-6, checked on the simulated GPU's record (trainer/schedule.py)."""
from __future__ import annotations

from tests.simulated import schedule
from tests.simulated.harness import run_simulated


def test_schedule():
    run_simulated(schedule.run_checks, 4, [{"names": ["offload_copies_on_copy_stream",
                                                      "offload_reductions_bounded", "offload_tables_copied_ahead",
                                                      "hybrid_all_reduce_on_its_stream",
                                                      "backward_overlaps_like_fsdp2",
                                                      "activation_offload_on_copy_stream"]}])
