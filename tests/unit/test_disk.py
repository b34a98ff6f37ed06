"""A full disk (disk.py) on a real one: a small tmpfs, filled. Needs root to mount it (skipped otherwise); the
full disk through the executable: tests/integration/test_checkpoint.py."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardtune.checkpoint.manager import _first_line
from shardtune.disk import disk_full, nearly_full, write_text_atomic
from shardtune.errors import UserError


@pytest.fixture
def full_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("needs root, to mount a small tmpfs")
    (disk / "recipe.yaml").write_text("train: {lr: 1.0e-3}\n")
    (disk / "filler").write_bytes(b"\0" * shutil.disk_usage(disk).free)
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_an_atomic_write_on_a_full_disk_keeps_the_old_file_and_leaves_no_other(full_disk):
    with pytest.raises(UserError, match=f"^no space left on device writing {full_disk / 'recipe.yaml'}: "):
        write_text_atomic(full_disk / "recipe.yaml", "train: {lr: 2.0e-3}\n" * 1000)
    assert (full_disk / "recipe.yaml").read_text() == "train: {lr: 1.0e-3}\n"
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "recipe.yaml"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_on_a_full_disk_is_recognised_inside_dcps_exception(full_disk):
    with pytest.raises(dcp.CheckpointException) as caught:
        dcp.save({"w": torch.ones(1 << 16)}, checkpoint_id=str(full_disk / "step_1"))
    assert "No space left" not in str(caught.value).splitlines()[0]  # DCP's first line: only "ranks: [0]"
    assert disk_full(caught.value) and nearly_full(full_disk)
    assert _first_line(caught.value) == "OSError: [Errno 28] No space left on device"  # the rank's own exception
