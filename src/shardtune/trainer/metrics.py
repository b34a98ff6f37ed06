"""The run directory's records, written by rank 0: metrics.jsonl, TensorBoard events, loss.png, W&B and MLflow runs
(trainer/trackers.py, with train.report_to); progress on stdout (trainer/progress.py)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardtune.trainer.progress import make_progress


class MetricsLog:
    def __init__(self, run_dir: Path, *, max_steps: int, enabled: bool, start_step: int = 0, log_every: int = 20,
                 show_epoch: bool = False, report_to: Sequence[str] = ("tensorboard",),
                 config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = max_steps
        self.history: list[dict[str, Any]] = []
        self._tb = None
        self._progress = None
        self._trackers = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.history = _read_until(self.path, start_step)  # on resume: keep lines up to the checkpoint, drop later
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self._file = self.path.open("a")
        try:
            if "tensorboard" in report_to:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is a dependency; a stripped install still trains
            self._tb = None
        others = [t for t in report_to if t != "tensorboard"]
        if others:
            from shardtune.trainer.trackers import Trackers

            self._trackers = Trackers(others, run_dir, config or {}, resume=start_step > 0)
        self._progress = make_progress(max_steps=max_steps, start_step=start_step, log_every=log_every,
                                       show_epoch=show_epoch)

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
        if self._trackers is not None:
            self._trackers.log(record)
        self._progress.update(record)

    def last_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None

    def close(self, run_dir: Path) -> None:
        if not self.enabled or self._file.closed:
            return
        self._progress.close()  # the live display (or the last plain line) becomes a one-line summary
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None:
            self._trackers.close()
        self._file.close()
        plot_loss(self.history, run_dir / "loss.png")


    def print_summary(self, acc_before: float | None, acc_after: float | None, before_note: str = "") -> None:
        """`before_note`: what "before" was after a resume (trainer/evaluate.py accuracy_before)."""
        from rich.console import Console
        from rich.table import Table

        history = self.history
        table = Table(title="loss")
        for col in ("step", "loss", "eval_loss", "tokens/s"):
            table.add_column(col, justify="right")
        picks = sorted({0, len(history) // 4, len(history) // 2, 3 * len(history) // 4, len(history) - 1})
        for i in picks:
            if 0 <= i < len(history):
                r = history[i]
                ev = f"{r['eval_loss']:.4f}" if "eval_loss" in r else ""
                table.add_row(str(r["step"]), f"{r['loss']:.4f}", ev, f"{r['tokens_per_s']:.0f}")
        console = Console()
        console.print(table)
        if acc_before is not None and acc_after is not None:
            console.print(f"held-out exact-match accuracy: before {acc_before:.1%}{before_note} -> after "
                          f"{acc_after:.1%}", soft_wrap=True)  # one line, whatever the console's width


def _read_until(path: Path, step: int) -> list[dict[str, Any]]:
    if step == 0 or not path.exists():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if r["step"] <= step]


def plot_loss(history: list[dict[str, Any]], out: Path) -> None:
    # The object API, not pyplot: no backend selection, no global figure registry (rendered by Agg through savefig).
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
