"""The session's SLURM cluster: slurmctld + 2 slurmd on loopback, started once, stopped by PID at the end.

Without root or SLURM the tests skip with the reason; with SHARDTUNE_REQUIRE_SLURM=1 (CI) they fail instead,
and the packages are installed with apt-get when missing.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.slurm.cluster import LocalSlurm, SlurmUnavailable, find_or_install

REQUIRED = os.environ.get("SHARDTUNE_REQUIRE_SLURM") == "1"
NODES = 2


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/slurm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.slurm)


@contextmanager
def _exclusive(lock: Path):
    """One cluster per machine at a time: the daemons use a fixed base and fixed ports, and a start stops the
    daemons a killed session left behind. A second suite running at once waits here for the first one's SLURM
    tests (the kernel drops the lock of a killed session, so what the next start finds is truly stale)."""
    import fcntl

    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")  # module: the lock is released once the SLURM tests are done, not at session end
def slurm_cluster(tmp_path_factory):
    try:
        find_or_install(install=REQUIRED)
    except SlurmUnavailable as e:
        if REQUIRED:
            pytest.fail(f"SHARDTUNE_REQUIRE_SLURM=1 but SLURM cannot run here: {e}")
        pytest.skip(f"no local SLURM: {e} (CI sets SHARDTUNE_REQUIRE_SLURM=1 to make this a failure)")
    # A fixed base (not tmp_path) so that a session killed before teardown has its daemons stopped by the next.
    base = Path(os.environ.get("SHARDTUNE_SLURM_DIR", f"/tmp/shardtune-slurm-{os.getuid()}"))
    # Each node runs one task with one worker; 2 CPUs per node leave room for torchrun's agent and the launcher.
    with _exclusive(base.parent / f"{base.name}.lock"), LocalSlurm(base, nodes=NODES, cpus=2) as cluster:
        yield cluster
