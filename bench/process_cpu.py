"""CPU seconds of every process a command starts (Linux /proc), e.g. the launcher, torchrun's agent and each worker
of a CLI training:

    .venv/bin/python bench/process_cpu.py .venv/bin/shardtune train tiny-cpu train.max_steps=2 \
        train.output_dir=/tmp/pc train.demo_eval=false train.eval_every=0 train.save_every=0

Every 0.1 s it reads utime + stime of the command and of every process whose command line names shardtune or torch;
each process is reported with its last reading, so up to 0.1 s of a process's end goes unseen. Prints one line per
process (CPU-s, pid, command line) and the total.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_file: str) -> float:
    """utime + stime of a /proc/PID/stat or /proc/PID/task/TID/stat file (fields 14, 15), in seconds."""
    fields = open(stat_file).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _reading(pid: str) -> tuple[str, float] | None:
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        return cmdline.strip(), cpu_seconds(f"/proc/{pid}/stat")
    except OSError:  # gone between listing and reading
        return None


def main(cmd: list[str]) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[str, tuple[str, float]] = {}
    while proc.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            got = _reading(pid)
            if got and (int(pid) == proc.pid or "shardtune" in got[0] or "torch" in got[0]):
                seen[pid] = got
        time.sleep(0.1)
    for pid, (cmdline, cpu) in sorted(seen.items(), key=lambda kv: int(kv[0])):
        print(f"{cpu:7.2f} {pid:>7} {cmdline[:140]}")
    print(f"{sum(cpu for _, cpu in seen.values()):7.2f} total (exit code {proc.returncode})")


if __name__ == "__main__":
    main(sys.argv[1:])
