"""How the launcher words a worker's death (trainer/worker_deaths.py), from the agent's report and the ranks' logs. The real
SIGKILL through the CLI: tests/integration/test_checkpoint.py."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from shardtune.trainer import worker
from shardtune.trainer.signals import SETUP_INTERRUPTS, StopRequest
from shardtune.trainer.worker_deaths import EXIT_WORKER_DIED, checkpoint_line, describe, rank_log

PEER_LOST = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: [pair.cc:553] "
             "Connection closed by peer [127.0.0.1]:22164\n")


def failure(rank: int, exitcode: int, timestamp: int = 100) -> dict:
    return {"rank": rank, "local_rank": rank, "exitcode": exitcode, "pid": 1000 + rank, "timestamp": timestamp,
            "host": "node7"}


def write_log(run: Path, rank: int, text: str) -> None:
    rank_log(run, rank).parent.mkdir(parents=True, exist_ok=True)
    rank_log(run, rank).write_text(text)


def test_the_signalled_rank_is_named_not_the_one_that_lost_its_peer(tmp_path):
    write_log(tmp_path, 0, PEER_LOST)  # rank 0 failed first on the broken connection, rank 1 was SIGKILLed
    code, line = describe([failure(0, 1, timestamp=99), failure(1, -9)], tmp_path, 2)
    assert code == EXIT_WORKER_DIED
    assert line.startswith("rank 1 on node7 was killed by SIGKILL: probably the out-of-memory killer: check `dmesg`")
    assert line.endswith("; the other ranks were stopped") and "\n" not in line


def test_a_native_crash_points_to_its_log(tmp_path):
    write_log(tmp_path, 1, "Fatal Python error: Segmentation fault\n")
    code, line = describe([failure(1, -11)], tmp_path, 1)
    assert code == EXIT_WORKER_DIED and "SIGSEGV" in line and str(rank_log(tmp_path, 1)) in line
    assert "other ranks" not in line  # a single worker has none


def test_an_exit_without_our_message_names_the_rank_and_its_log(tmp_path):
    code, line = describe([failure(3, 7)], tmp_path, 4)
    assert code == EXIT_WORKER_DIED
    assert line == (f"rank 3 on node7 exited with code 7 without a message: see {rank_log(tmp_path, 3)}; "
                    "the other ranks were stopped")


def complete_checkpoint(run: Path, step: int) -> Path:
    ckpt = run / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text("{}")
    return ckpt


def test_the_line_names_the_newest_checkpoint_and_the_command_that_resumes_it(tmp_path):
    """The death line ends with what a relaunch continues from: the newest complete checkpoint (not one whose save
    the death cut short) and the command that was run, which resumes it (train.resume=auto by default)."""
    argv = ["train", "my recipe.yaml", f"train.output_dir={tmp_path}", "train.save_every=3"]
    complete_checkpoint(tmp_path, 3)
    newest = complete_checkpoint(tmp_path, 6)
    (tmp_path / "checkpoints" / ".tmp-step_9").mkdir()  # being written when the worker died
    assert checkpoint_line(tmp_path, argv, resume="auto", save_every=3) == (
        f"checkpoint: {newest}: resume with `shardtune train 'my recipe.yaml' train.output_dir={tmp_path} "
        "train.save_every=3`")


def test_a_run_started_from_a_named_checkpoint_resumes_from_its_newest(tmp_path):
    """train.resume named a checkpoint (or none): the same command would load that one again (or start over), so
    the command says train.resume=auto."""
    newest = complete_checkpoint(tmp_path, 6)
    argv = ["train", "r.yaml", "train.resume=elsewhere/checkpoints/step_3", "train.lr=1e-4"]
    assert checkpoint_line(tmp_path, argv, resume="elsewhere/checkpoints/step_3", save_every=3) == (
        f"checkpoint: {newest}: resume with `shardtune train r.yaml train.lr=1e-4 train.resume=auto`")


def test_without_a_checkpoint_the_line_says_so_and_what_the_command_does(tmp_path):
    assert checkpoint_line(tmp_path, ["train", "r.yaml"], resume="auto", save_every=0) == (
        "checkpoint: none (train.save_every=0): `shardtune train r.yaml` starts the run again from step 0")
    assert checkpoint_line(tmp_path, ["train", "r.yaml", "train.resume=old/step_3"], resume="old/step_3",
                           save_every=5) == (
        "checkpoint: none newer than old/step_3 (train.save_every=5): `shardtune train r.yaml "
        "train.resume=old/step_3` resumes from it again")


def test_a_traceback_is_an_internal_error_unless_a_peer_was_lost(tmp_path):
    write_log(tmp_path, 0, "Traceback (most recent call last):\nKeyError: 'x'\n")
    assert describe([failure(0, 1)], tmp_path, 2)[0] == 1
    write_log(tmp_path, 0, PEER_LOST)  # on the other node of a multi-node job: a consequence
    code, line = describe([failure(0, 1)], tmp_path, 2)
    assert code == EXIT_WORKER_DIED and "lost its connection to another rank" in line


def test_the_real_failure_is_named_when_a_peer_lost_it_in_the_same_second(tmp_path):
    """Rank 1 hit a bug; rank 0 then failed on the broken connection within the same second (torch's timestamps
    are whole seconds): rank 1's traceback is the cause, not rank 0's lost peer."""
    write_log(tmp_path, 0, PEER_LOST)
    write_log(tmp_path, 1, "Traceback (most recent call last):\nKeyError: 'x'\n")
    code, line = describe([failure(0, 1), failure(1, 1)], tmp_path, 2)
    assert code == 1 and line.startswith("rank 1 on node7 failed with an internal error"), line


def test_the_agent_ends_in_one_line_when_the_rendezvous_host_is_gone(tmp_path, monkeypatch, capsys):
    """Multi-node: the first node's agent (the rendezvous store's host) ends right after a worker died there; the
    other node's agent then fails to reach the store. It stops its workers (torch's agent does, on the way out) and
    says so in one line, without a traceback in the job log."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from shardtune.launcher import agent

    def lost(_args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torchrun, "run", lost)
    code = agent.main([str(tmp_path / "failures.json"), "--nproc-per-node=1", "--standalone", "-m", "shardtune.trainer.worker"])
    err = capsys.readouterr().err
    assert code == 1 and not (tmp_path / "failures.json").exists()
    assert err.count("\n") == 1 and "rendezvous host" in err and "Traceback" not in err


def test_ctrl_c_while_the_worker_opens_its_log_is_one_line(tmp_path, monkeypatch):
    """The setup window starts where the worker takes SIGINT back from the agent: a Ctrl-C that lands while it
    redirects stderr to its rank log (CI caught one in the import there: a traceback) is the one line, exit 130."""
    def interrupted(path):
        raise KeyboardInterrupt

    error_file = tmp_path / "logs" / ".user_error"
    error_file.parent.mkdir()  # the launcher makes it
    monkeypatch.setattr(worker, "_stderr_to_log", interrupted)
    assert _worker_main_exit(monkeypatch, str(tmp_path / "recipe.yaml"), f"--error-file={error_file}") == 130
    assert (tmp_path / "logs" / ".exit_code").read_text().startswith("130\ninterrupted (Ctrl-C, SIGINT) before")


@pytest.mark.parametrize("unwinds_as", [KeyboardInterrupt, AttributeError])
def test_ctrl_c_while_loading_the_recipe_is_one_line(monkeypatch, capsys, unwinds_as):
    """A real SIGINT while the recipe loads: exit 130 and the one line, also when a library turns the
    KeyboardInterrupt into an error of its own as it unwinds (omegaconf did: an AttributeError out of its schema
    building, which the launcher reported as an internal error; test_checkpoint's ctrl-c-in-setup case caught it)."""
    def load_recipe(path: str):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered at the next bytecode
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            if unwinds_as is KeyboardInterrupt:
                raise
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'") from None
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(worker, "load_recipe", load_recipe)
    monkeypatch.setenv("RANK", "0")
    assert _worker_main_exit(monkeypatch, "recipe.yaml") == 130
    assert capsys.readouterr().err.strip() == (
        "shardtune: interrupted (Ctrl-C, SIGINT) before the first step; checkpoint: none")


def _worker_main_exit(monkeypatch, *argv: str) -> int:
    """`python -m shardtune.trainer.worker ARGV` in this process: its exit code; this process's SIGINT handling as
    it was."""
    monkeypatch.setattr(sys, "argv", ["worker", *argv])
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            worker.main()
    finally:
        signal.signal(signal.SIGINT, before)
        SETUP_INTERRUPTS.clear()
    return stopped.value.code


def test_a_setup_ctrl_c_that_a_library_swallowed_still_stops_the_run():
    """The interrupt was recorded but never reached the worker's except clause: training's stop request starts
    out as SIGINT, so every rank agrees to stop at the first step boundary (exit 130 and its line)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        assert StopRequest().signum is None
        SETUP_INTERRUPTS.append(signal.SIGINT)
        assert StopRequest().signum == signal.SIGINT
    finally:
        SETUP_INTERRUPTS.clear()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
