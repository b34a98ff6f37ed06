"""One live run per run directory: `<output_dir>/.lock` holds the launcher's host and pid while it runs.

Two launches into one directory would interleave metrics.jsonl and overwrite each other's checkpoints and final/.
The second is refused (exit 2) while the owner lives. A lock whose owner is gone (same host, no such pid: a
SIGKILL, a crashed node) is stale: taken over with a warning. A lock from another host cannot be checked from
here: refused, naming the file to delete if that run is over, unless it names this SLURM job: a requeued job
(same job id, perhaps another node) after its previous attempt was killed. Multi-node jobs: only the first node's
launcher takes it (the nodes of one job share the directory).
"""
from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

from shardtune.disk import disk_full, no_space_line
from shardtune.errors import UserError

LOCK_FILE = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RunLock:
    """Context manager: holds `run_dir/.lock` from enter to exit."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        job = os.environ.get("SLURM_JOB_ID")
        self.job = f"slurm-job-{job}" if job else None
        self.owner = " ".join(filter(None, [socket.gethostname(), str(os.getpid()), self.job]))

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(self.owner + "\n")
            except OSError as e:  # an empty lock would read as garbage to the next launch: leave none
                self.path.unlink(missing_ok=True)
                raise UserError(no_space_line(self.path) if disk_full(e) else f"cannot write {self.path}: "
                                f"{e.strerror}") from None
            return self
        raise UserError(f"train.output_dir: '{self.path.parent}' is being locked by another launch at this moment: "
                        "use another train.output_dir")

    def _take_over_if_stale(self) -> None:
        try:
            host, pid, *job = self.path.read_text().split()
            owner_pid = int(pid)
        except (OSError, ValueError):  # being written, or garbage: a live writer takes microseconds
            host, owner_pid, job = "?", -1, []
        requeued = self.job is not None and job == [self.job]
        if requeued or host == socket.gethostname() and owner_pid > 0 and not _alive(owner_pid):
            warnings.warn(f"{self.path}: its run (pid {owner_pid}) is gone; taking the run directory over",
                          stacklevel=3)
            self.path.unlink(missing_ok=True)
            return
        raise UserError(f"train.output_dir: '{self.path.parent}' is in use by a run on {host} (pid {owner_pid}): "
                        f"wait for it or stop it, or use another train.output_dir (if that run is over, delete "
                        f"{self.path})")

    def __exit__(self, *exc: object) -> None:
        try:
            if self.path.read_text().strip() == self.owner:
                self.path.unlink()
        except OSError:
            pass
