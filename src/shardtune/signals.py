"""Graceful stop: SIGTERM (torchrun, schedulers) or SIGUSR1 (SLURM's warning before preemption) asks the worker to
finish the current step, save a checkpoint and exit with EXIT_PREEMPTED. The handler only sets a flag; the stop is
agreed on by all ranks at a step boundary (one all-reduce), because a signal may reach only some of them."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "stopped on request, checkpoint saved: run the same command to resume"
EXIT_DIVERGED = 4  # a NaN/inf loss or gradient norm stopped the run (the last good checkpoint stays)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> bool:
        """Collective: True when any rank received a stop signal."""
        t = torch.tensor([1 if self.signum is not None else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        from shardtune import accelerator

        return bool(accelerator.item(t))
