"""Issue 20's GPU crashes 1-3 on the simulated GPU (findings.py says what each checks). Each failed on the code
before its fix: the report of issue 20a records how that was checked."""
from __future__ import annotations

from tests.simulated import findings
from tests.simulated.harness import run_simulated

NAMES = ["host_tensor_refused", "checkpoint_agreement", "offload_checkpoint_state", "fused_step_placement",
         "torch_offload_collectives"]


def test_findings_1_to_3(tmp_path):
    """One start of 2 ranks for the three; a failure names the finding's function in its traceback."""
    run_simulated(findings.run_findings, 2, [{"base": str(tmp_path), "names": NAMES}])
