"""A save that fails on one rank (disk full) leaves the previous checkpoint intact, on every rank's say-so."""
from __future__ import annotations

import errno
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tests.distributed.harness import run_distributed

from shardtune.checkpoint.manager import CheckpointManager, find_resume_dir, load


def _scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    """A real LambdaLR over a one-parameter optimizer: a load restores the schedule's step counter into it
    (checkpoint/manager.py restore_schedule_step), which a stand-in without base_lrs and lr_lambdas cannot take."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


class DiskFullWriter(dcp.FileSystemWriter):
    """Fails to write data on rank 1 only, as a full local disk would."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_data(plan, planner)


def _disk_full(out: str) -> None:
    run = Path(out)
    mgr = CheckpointManager(run, keep_last=0, is_main=dist.get_rank() == 0, rank=dist.get_rank())
    good = {"w": torch.full((4,), float(dist.get_rank() + 1))}
    assert mgr.save(1, good, _scheduler(), {"world_size": 2}) is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = {"w": torch.full((4,), 99.0)}
        result = mgr.save(2, bad, _scheduler(), {"world_size": 2},
                          storage_writer=DiskFullWriter(str(run / "checkpoints" / ".tmp-step_2")))
    assert result is None
    if dist.get_rank() == 0:
        assert any("step_1" in str(w.message) and "intact" in str(w.message) for w in caught)
    assert not (run / "checkpoints" / ".tmp-step_2").exists() and not (run / "checkpoints" / "step_2").exists()
    found = find_resume_dir(run, "auto", is_main=False)
    assert found == run / "checkpoints" / "step_1"
    back = {"w": torch.zeros(4)}
    assert load(found, back, _scheduler(), rank=dist.get_rank(), world_size=2) == 1
    assert back["w"].tolist() == [1.0] * 4  # the replicated tensor from the good save (rank 0 wrote it)


def test_disk_full_keeps_previous_checkpoint(tmp_path):
    run_distributed(_disk_full, 2, [{"out": str(tmp_path)}])


def test_keep_last_prunes_oldest(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4):
        (root / f"step_{s}").mkdir(parents=True)
        (root / f"step_{s}" / "trainer.json").write_text("{}")
    (root / "step_5").mkdir()  # incomplete (no trainer.json): never counted, never picked
    CheckpointManager(tmp_path, keep_last=2, is_main=True, rank=0)._prune()
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_5"]
    assert find_resume_dir(tmp_path, "auto", is_main=True) == root / "step_4"
