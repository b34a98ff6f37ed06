"""Shared by the multi-node and SLURM tests: one small fp32 run, and its local 2-worker reference (run once)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
MAX_STEPS = 10
# Small and fp32 (the recipe's default): one worker thread each, so 2 cores hold two "nodes" plus the others' tests.
COMMON = [f"train.max_steps={MAX_STEPS}", "data.num_samples=200", "data.seq_len=64", "train.micro_batch_size=4",
          "train.demo_eval=false", "train.save_final=false", "launch.threads_per_worker=1", "launch.device=cpu",
          "engine.mixed_precision=fp32"]
_reference: dict[str, list[float]] = {}


def run_train(run_dir: Path, *overrides: str, cwd: Path, timeout: int = 900) -> subprocess.Popen:
    cmd = [SHARDTUNE, "train", "tiny-cpu", *COMMON, f"train.output_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> list[float]:
    """Per-step training loss; for a resumed run the last line logged for each step wins."""
    by_step = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def reference_losses(base: Path) -> list[float]:
    """One node, 2 workers, same recipe: what every multi-node variant must reproduce (computed once, on forked
    ranks: the launcher's checks and the worker without the CLI's start-up, tests/integration/forked.py)."""
    if "ref" not in _reference:
        from tests.integration import forked

        run = base / "reference-1x2"
        result = forked.train("tiny-cpu", *COMMON, f"train.output_dir={run}", world=2)
        assert result.code == 0, result.err[-3000:]
        _reference["ref"] = losses(run)
        assert len(_reference["ref"]) == MAX_STEPS
    return _reference["ref"]


def assert_same_losses(got: list[float], want: list[float], rel: float = 1e-6) -> None:
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert math.isclose(g, w, rel_tol=rel), f"step {step}: loss {g} != reference {w}"
