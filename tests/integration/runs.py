"""Helpers for tests that run the real CLI: launch, wait, kill whole process trees, read metrics."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
# Small and quick: 6 steps of the tiny Llama on builtin:reverse.
FAST = ["data.num_samples=300", "data.seq_len=64", "train.max_steps=6", "train.demo_eval=false",
        "train.eval_every=0", "train.warmup_steps=0"]


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDTUNE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def forked_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`shardtune ARGS` as `cli` runs it (same `main`, exit code, stdout, stderr), but in a process forked from the
    suite's preloaded server (tests/ranks.py) instead of a fresh interpreter: ~5 s of CPU less per call (torch and
    transformers are imported). For tests of what a command computes (plan, validate, prepare, export, generate);
    what the executable itself does (its start-up, usage errors, signals, torchrun) is tested through `cli`.
    The environment is this process's at the call, not the server's at its start."""
    from tests.ranks import start_local_ranks

    with tempfile.TemporaryDirectory() as logs:
        start_local_ranks(_forked_main, (list(args), str(cwd), dict(os.environ), logs), 1)
        out, err, code = ((Path(logs) / name).read_text() for name in ("out", "err", "code"))
    return subprocess.CompletedProcess([SHARDTUNE, *args], int(code), out, err)


def _forked_main(_rank: int, argv: list[str], cwd: str, env: dict[str, str], logs: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    console_to_files(logs)
    sys.argv = [SHARDTUNE, *argv]
    from shardtune.launcher.cli import main

    try:
        main()
        code = 0
    except SystemExit as e:  # what the interpreter would do with it
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # an uncaught error: the traceback, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    (Path(logs) / "code").write_text(str(code))


def console_to_files(logs: str | Path) -> None:
    """This process's stdout and stderr (the file descriptors, so child output and C-level writes too) into the files
    `out` and `err` under `logs`."""
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(Path(logs) / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([SHARDTUNE, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [d for k in kids for d in descendants(k)]


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_for(cond, timeout: float = 240, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def summary(run_dir: Path) -> dict:
    """summary.json: final_loss, and accuracy_before/accuracy_after (fractions) when train.demo_eval is on."""
    return json.loads((run_dir / "summary.json").read_text())
