"""The agent (launcher/agent.py) as the launcher runs it, on two workers where rank 1 raises and rank 0 is busy: torch's
agent then stops rank 0 with its own SIGTERM. The report marks that, and the launcher's line blames rank 1."""
from __future__ import annotations

import json
import subprocess
import sys

from shardtune.trainer.worker_deaths import EXIT_WORKER_DIED, describe, read_report

WORKER = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(1)  # what every rank of a failing run does, rank 0 a moment later than here
time.sleep(120)  # rank 0, still busy: stopped by the agent
"""


def test_the_agents_own_sigterm_is_not_blamed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    report = tmp_path / "failures.json"
    proc = subprocess.run([sys.executable, "-m", "shardtune.launcher.agent", str(report), "--standalone",
                           "--nproc-per-node=2", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    by_rank = {f["rank"]: f for f in read_report(report)}
    assert by_rank[0]["exitcode"] == -15 and by_rank[0]["stopped_by_agent"], json.dumps(by_rank)
    assert by_rank[1]["exitcode"] == 1 and not by_rank[1]["stopped_by_agent"]
    code, line = describe(list(by_rank.values()), tmp_path, 2)
    assert code == EXIT_WORKER_DIED and line.startswith("rank 1 on ") and "SIGTERM" not in line, line
