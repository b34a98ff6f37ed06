"""Graceful stop: SIGTERM (torchrun, schedulers), SIGUSR1 (SLURM's warning before preemption) or SIGINT (Ctrl-C)
asks the worker to finish the current step, save a checkpoint (whatever train.save_every says: a stop must lose
nothing) and exit: EXIT_PREEMPTED, or EXIT_INTERRUPTED for
Ctrl-C (the shell's code for it). The handler only sets a flag; the stop is agreed on by all ranks at a step
boundary, because a signal may reach only some of them: each rank's vote rides on the step's own all-reduce and host
read (trainer/train.py train_step), so agreeing costs no collective and no GPU sync of its own."""
from __future__ import annotations

import signal
from pathlib import Path

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "stopped on request, checkpoint saved: run the same command to resume"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_DIVERGED = 4  # a NaN/inf loss or gradient norm stopped the run (the last good checkpoint stays)


def stop_message(signum: int | None, step: int, checkpoint: Path | None, *, resume: str = "auto") -> tuple[str, int]:
    """(the line, the exit code) for a run stopped by `signum` after `step` (0: before the first step), with
    `checkpoint` the newest one saved (None: none). How to resume: the same command, unless `train.resume` (`resume`)
    names another checkpoint, which the same command would load again."""
    when = f"after step {step}" if step else "before the first step"
    saved = "none"
    if checkpoint is not None:
        again = "the same command" if resume in ("auto", "force") else "the same command with train.resume=auto"
        saved = f"{checkpoint}: run {again} to resume"
    if signum == signal.SIGINT:
        return f"interrupted (Ctrl-C, SIGINT) {when}; checkpoint: {saved}", EXIT_INTERRUPTED
    name = signal.Signals(signum).name if signum else "a signal"
    return f"stopped by signal {name} {when}; checkpoint: {saved}", EXIT_PREEMPTED


# SIGINTs a worker received while setting up (trainer/worker.py records them). One that a library swallowed on the
# way (a KeyboardInterrupt raised inside a finalizer is printed and dropped) is still Ctrl-C: the run stops at its
# first step boundary, with the other ranks, instead of training on.
SETUP_INTERRUPTS: list[int] = []


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = SETUP_INTERRUPTS[-1] if SETUP_INTERRUPTS else None
        self.stopping = False  # agreed by all ranks at the last step boundary
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def vote(self) -> int:
        """This rank's part of the agreement: 1 once it received a stop signal, else 0."""
        return int(self.signum is not None)

    def settle(self, votes: float) -> bool:
        """`votes`: every rank's `vote` summed (the same number on every rank): stop when any rank asked. Sets and
        returns `stopping`."""
        self.stopping = votes > 0
        return self.stopping
