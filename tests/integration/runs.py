"""Helpers for tests that run the real CLI: launch, wait, kill whole process trees, read metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
# Small and quick: 6 steps of the tiny Llama on builtin:reverse.
FAST = ["data.num_samples=300", "data.seq_len=64", "train.max_steps=6", "train.demo_eval=false",
        "train.eval_every=0", "train.warmup_steps=0"]


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDTUNE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


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
