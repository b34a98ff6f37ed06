"""The run directory's records, written by rank 0: metrics.jsonl, TensorBoard events, loss.png, progress."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: Path, *, max_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = max_steps
        self.history: list[dict[str, Any]] = []
        self._tb = None
        self._progress = None
        self._t0 = time.perf_counter()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is a dependency; a stripped install still trains
            self._tb = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=max_steps, info="")
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, record["step"])
        info = " ".join(f"{k}={_fmt(record[k])}" for k in ("loss", "eval_loss", "tokens_per_s") if k in record)
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], info=info)
        else:
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / max(record["step"], 1) * (self.max_steps - record["step"])
            print(f"step {record['step']}/{self.max_steps} {info} eta={eta:.0f}s", flush=True)

    def close(self, run_dir: Path) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
        plot_loss(self.history, run_dir / "loss.png")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def plot_loss(history: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
