"""Demo time to first step: `shardtune train tiny-cpu` launch -> its first `step 1/` line, cold and warm data cache.

    .venv/bin/python bench/first_step.py                       # this checkout, 3 runs each
    .venv/bin/python bench/first_step.py --other-src OLD/src   # + another checkout's code, interleaved (A/B)

cold: a fresh output_dir, so the data cache is built (rank 0 tokenizes, imports `datasets`); warm: a fixed
data.cache_dir that the first run filled (a second run, a resume, a requeue). Medians; run on an idle machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXE = str(Path(sys.executable).with_name("shardtune"))


def first_step_s(out: Path, *, src: str | None = None, extra: tuple[str, ...] = ()) -> float:
    env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([EXE, "train", "tiny-cpu", "train.max_steps=3", "train.log_every=1",
                             f"train.output_dir={out}", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=out.parent)
    seen = None
    for line in proc.stdout:
        if seen is None and line.startswith("step 1/"):
            seen = time.perf_counter() - t0
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"run failed (exit {proc.returncode})")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--other-src", help="a checkout's src/ to compare with (PYTHONPATH), run interleaved")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = ("data.cache_dir=" + str(tmp / "cache"),)
        first_step_s(tmp / "run", extra=warm)  # fills the warm cache
        res: dict[str, list[float]] = {"cold": [], "warm": [], "other": []}
        for _ in range(args.runs):
            if args.other_src:
                res["other"].append(first_step_s(tmp / "run", src=args.other_src))
            res["cold"].append(first_step_s(tmp / "run"))
            res["warm"].append(first_step_s(tmp / "run", extra=warm))
    for name, xs in res.items():
        if xs:
            print(f"{name:5s} median {statistics.median(xs):.2f} s  ({', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
