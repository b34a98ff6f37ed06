"""A worker that died without saying why, as one line: which rank, on which host, how, the likely cause and a fix.

The agent (launcher/agent.py) reports how each failed worker ended; a worker's own messages (user error, preemption,
divergence) are handled before this (launcher/launch.py). Each worker's stderr goes to `<run>/logs/rank_N.log` (trainer/worker.py):
a native crash report or our traceback lands there, not on the console, so a rank that merely lost its peer
(a gloo "connection closed" error) adds no traceback to the one line about the rank that died first.
The line ends with what a relaunch continues from (`checkpoint_line`): the newest complete checkpoint and the
exact command that resumes it, or that there is none. No torch here: the launcher stays light.
"""
from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path

from shardtune.checkpoint.paths import newest_complete

EXIT_WORKER_DIED = 5  # a worker was killed by a signal, or exited with no message of ours: see its log
LOG_DIR = "logs"

# The likely cause of each signal and what to do about it.
_CAUSES = {
    "SIGKILL": "probably the out-of-memory killer: check `dmesg`; `shardtune plan RECIPE` for the peak; "
               "lower train.micro_batch_size or data.seq_len",
    "SIGSEGV": "a crash in native code (torch, a kernel, a driver)",
    "SIGBUS": "a crash in native code, often a full /dev/shm or a truncated memory-mapped file",
    "SIGABRT": "native code aborted (torch, NCCL/gloo, a driver)",
    "SIGFPE": "a crash in native code",
    "SIGILL": "native code used an instruction this CPU lacks (a build for another CPU?)",
    "SIGTERM": "stopped from outside (a scheduler or a user) before it could checkpoint",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGHUP": "its terminal went away: run long jobs under nohup, tmux or a scheduler",
}


# What a collective raises on the ranks whose peer died (gloo, NCCL): a consequence, not a cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "DistNetworkError", "Broken pipe",
              "NCCL communicator was aborted", "DistBackendError")


def rank_log(run_dir: Path, rank: int) -> Path:
    return run_dir / LOG_DIR / f"rank_{rank}.log"


def read_report(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["failures"]
    except (OSError, ValueError, KeyError):
        return []


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def first_failure(failures: list[dict], run_dir: Path) -> dict:
    """The root cause: never a rank the agent itself stopped after another failed (launcher/agent.py); first a rank killed
    by a signal, then one whose log does not end on a lost peer (those fail on
    the broken connection of a rank that died), then the earliest (torch's timestamps are whole seconds: a rank
    that lost its peer in the same second as the real failure must not be blamed)."""
    return min(failures, key=lambda f: (f.get("stopped_by_agent", False), f["exitcode"] >= 0,
                                        _lost_a_peer(rank_log(run_dir, f["rank"])), f["timestamp"], f["rank"]))


def last_traceback(log: Path) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return text[text.rindex("Traceback (most recent call last)"):] if "Traceback (most recent call last)" in text else ""


def _lost_a_peer(log: Path) -> bool:
    return any(p in last_traceback(log) for p in _PEER_LOST)


def describe(failures: list[dict], run_dir: Path, world_size: int) -> tuple[int, str]:
    """(exit code, the one line) for the first failure. An exit 1 with a traceback in the rank's log is an
    internal error (exit 1, "please report it"); everything else is EXIT_WORKER_DIED."""
    f = first_failure(failures, run_dir)
    rank, host, code = f["rank"], f["host"], f["exitcode"]
    log = rank_log(run_dir, rank)
    others = ("; the other ranks were stopped" if world_size > 1 else "")
    if code < 0:
        name = _signal_name(code)
        cause = _CAUSES.get(name, "killed from outside or by the system")
        where = f" (its log: {log})" if name not in ("SIGKILL", "SIGTERM", "SIGINT") and log.is_file() else ""
        return EXIT_WORKER_DIED, f"rank {rank} on {host} was killed by {name}: {cause}{where}{others}"
    if code == 1 and last_traceback(log):
        if _lost_a_peer(log):  # every failed rank here lost a peer: the one that died is on another node
            return EXIT_WORKER_DIED, (f"rank {rank} on {host} lost its connection to another rank, which probably "
                                      f"died first (on another node: that node's output says why); details in "
                                      f"{log}{others}")
        return 1, (f"rank {rank} on {host} failed with an internal error: traceback in {log} (please report it)"
                   f"{others}")
    if code == 2:  # a user error the worker could not hand over (a full disk): it printed it above
        return 2, f"rank {rank} on {host} stopped on the error above{others}"
    return EXIT_WORKER_DIED, f"rank {rank} on {host} exited with code {code} without a message: see {log}{others}"


def checkpoint_line(run_dir: Path, argv: list[str], *, resume: str, save_every: int) -> str:
    """The newest complete checkpoint in `run_dir` and the command that resumes from it: `shardtune ARGV` (the
    command that was run), with train.resume=auto when `resume` (train.resume) named a checkpoint or none, since the
    same command would then load that one again or start over. Without one: what the same command does."""
    same = shlex.join(["shardtune", *argv])
    newest = newest_complete(run_dir / "checkpoints")
    if newest is not None:
        again = same if resume in ("auto", "force") else shlex.join(
            ["shardtune", *(a for a in argv if not a.startswith("train.resume=")), "train.resume=auto"])
        return f"checkpoint: {newest}: resume with `{again}`"
    if resume in ("auto", "force", "none"):
        return f"checkpoint: none (train.save_every={save_every}): `{same}` starts the run again from step 0"
    return f"checkpoint: none newer than {resume} (train.save_every={save_every}): `{same}` resumes from it again"
