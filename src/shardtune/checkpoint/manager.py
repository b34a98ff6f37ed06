"""Sharded, resumable, atomic checkpoints with torch.distributed.checkpoint (DCP).

    <output_dir>/checkpoints/
        step_20/            complete: DCP shards + trainer.json (written last) + scheduler.pt + rng_rank*.pt
                            + hf/ (config, tokenizer, params.json: what `shardtune export` needs)
        latest              text "step_20", replaced atomically after the rename
        .tmp-step_30/       being written; never read; removed (with a warning) on resume

A save goes to the temp dir, every file is fsynced, then rank 0 renames it and updates `latest`: a crash at any
moment leaves the previous complete checkpoint loadable. A failure on any rank (a full disk...) is agreed on by all
ranks, the temp dir is removed, and training continues with a warning that the previous checkpoint is intact.

Coordination is host work and runs on the host group (accelerator.host_group(): gloo, also on GPU runs): the
agreement flag, the barriers and DCP's planning (pickled plans) are host objects. On an NCCL default group a host
tensor is refused ("No backend type associated with device type cpu"), and an object collective would stage every
plan through device memory and a device sync.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardtune import accelerator
from shardtune.checkpoint import storage
from shardtune.checkpoint.paths import TRAINER_FILE, explicit_resume_dir, is_complete, newest_complete
from shardtune.disk import disk_full, nearly_full, no_space_line, write_text_atomic


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    """DCP's exception says only which ranks failed on its first line: take the first rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else e
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return str(e).splitlines()[0][:200] if str(e) else ""


def _agree_ok(ok: bool) -> bool:
    """True only if every rank is ok (one all-reduce of a host flag, on the host group)."""
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=accelerator.host_group())
    return int(t) == 0


def _barrier() -> None:
    dist.barrier(group=accelerator.host_group())


def find_resume_dir(output_dir: Path, resume: str, *, is_main: bool) -> Path | None:
    """`auto`/`force`: the newest complete checkpoint in output_dir (None if there is none); `none`: None; else a
    path. (`force` differs only in the launcher's checks: checkpoint/resume_check.py.)"""
    if resume not in ("auto", "force"):
        return explicit_resume_dir(resume)  # None for "none"
    root = output_dir / "checkpoints"
    for tmp in sorted(root.glob(".tmp-*")) if root.is_dir() else []:
        if is_main:
            warnings.warn(f"ignoring incomplete checkpoint {tmp} (a save was interrupted); removing it", stacklevel=2)
            shutil.rmtree(tmp, ignore_errors=True)
    return newest_complete(root)


class CheckpointManager:
    def __init__(self, output_dir: Path, *, keep_last: int, is_main: bool, rank: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.root = output_dir / "checkpoints"
        self.device = device  # the compute device: which DCP storage (storage.storage_writer)
        self.keep_last = keep_last
        self.is_main = is_main
        self.rank = rank

    def save(self, step: int, state: dict[str, Any], scheduler: Any, export_info: dict[str, Any],
             write_hf: Any = None, storage_writer: dcp.StorageWriter | None = None) -> Path | None:
        """Collective. Returns the checkpoint dir, or None when the save failed (previous one intact)."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp-step_{step}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        ok, err = True, ""
        try:
            writer = storage_writer or storage.storage_writer(self.device, str(tmp))
            dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=accelerator.host_group())
            torch.save(_rng_state(), tmp / f"rng_rank{self.rank}.pt")
            if self.is_main:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                if write_hf is not None:
                    write_hf(tmp / "hf")
                _fsync_tree(tmp)
        except (Exception, dcp.CheckpointException) as e:  # OSError (disk full); DCP's wrapper is a BaseException
            full = disk_full(e) or nearly_full(tmp)
            ok, err = False, (no_space_line(tmp) if full else f"{type(e).__name__}: {_first_line(e)}")
        if not _agree_ok(ok):
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                prev = self.latest_name() or "none yet"
                warnings.warn(f"checkpoint at step {step} failed ({err or 'on another rank'}); the previous "
                              f"checkpoint ({prev}) is intact", stacklevel=2)
            _barrier()
            return None
        if self.is_main:
            write_text_atomic(tmp / TRAINER_FILE, json.dumps({"step": step, **export_info}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            write_text_atomic(self.root / "latest", final.name)
            self._prune()
        _barrier()
        return final

    def latest_name(self) -> str | None:
        latest = self.root / "latest"
        return latest.read_text().strip() if latest.is_file() else None

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        done = sorted((d for d in self.root.glob("step_*") if is_complete(d)), key=lambda d: int(d.name.split("_")[1]))
        for d in done[: -self.keep_last]:
            shutil.rmtree(d, ignore_errors=True)


def load(ckpt: Path, state: dict[str, Any], scheduler: Any, *, rank: int, world_size: int,
         device: torch.device = torch.device("cpu")) -> int:
    """Collective. Fills `state` in place, restores the scheduler and (same world size) RNG; returns the step."""
    info = json.loads((ckpt / TRAINER_FILE).read_text())
    dcp.load(state, checkpoint_id=str(ckpt), storage_reader=storage.storage_reader(device, str(ckpt)),
             planner=storage.load_planner(device), process_group=accelerator.host_group())
    restore_schedule_step(scheduler, torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = ckpt / f"rng_rank{rank}.pt"
    if info.get("world_size") == world_size and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return int(info["step"])


def restore_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any]) -> None:
    """Only the step counter comes from the checkpoint's scheduler state. Its peak rates (base_lrs) and its last
    rate are the old recipe's: loaded as they are, a resume with another train.lr kept the old one (announced and
    ignored). The peak and the shape (train.lr, schedule, warmup_steps, max_steps) are this recipe's, as built, so
    step k runs at the rate a run started with these settings would use at step k. The optimizer's groups get it
    too, or the first resumed step would run at the rate of step 0."""
    step = saved["last_epoch"]  # optimizer steps taken (a skipped non-finite step took none)
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_step_count": saved["_step_count"],
                               "_last_lr": lrs})
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
