"""One live run per run directory (launcher/run_lock.py): a live owner refuses, a dead one on this host is taken over, the
lock goes with the run. Through the executable: tests/integration/test_checkpoint.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardtune.errors import UserError
from shardtune.launcher.run_lock import LOCK_FILE, RunLock


def test_a_live_owner_refuses_and_the_lock_goes_with_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{socket.gethostname()} {os.getpid()}\n"
        with pytest.raises(UserError, match=f"is in use by a run on .* \\(pid {os.getpid()}\\)"):
            RunLock(tmp_path).__enter__()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_dead_owner_on_this_host_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # exited: its pid names no process now
    (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()} {dead}\n")
    with pytest.warns(UserWarning, match=f"pid {dead}"), RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().split() == [socket.gethostname(), str(os.getpid())]


def test_another_hosts_lock_is_not_guessed_at(tmp_path):
    (tmp_path / LOCK_FILE).write_text("elsewhere 1\n")
    with pytest.raises(UserError, match=f"in use by a run on elsewhere .*delete {tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).__enter__()


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / LOCK_FILE).write_text("node-that-died 77 slurm-job-4242\n")  # the killed attempt, another host
    with pytest.warns(UserWarning, match="pid 77"), RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().split()[2] == "slurm-job-4242"
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job: not ours to take
    (tmp_path / LOCK_FILE).write_text("node-that-died 77 slurm-job-4242\n")
    with pytest.raises(UserError, match="in use by a run on node-that-died"):
        RunLock(tmp_path).__enter__()
