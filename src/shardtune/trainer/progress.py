"""Progress on stdout: training (rank 0) and `export`.

Training: On a terminal: one live rich line (step, loss, lr, tokens/s, peak memory, ETA)
that is replaced by a one-line summary at the end. Otherwise (a log file, SLURM output, a pipe): a plain line at
step 1, every `train.log_every` steps, at eval steps and at the last step, then the same summary. metrics.jsonl
keeps every step either way (trainer/metrics.py)."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

GiB = 1 << 30


def make_progress(*, max_steps: int, start_step: int, log_every: int, out: TextIO | None = None,
                  live: bool | None = None, show_epoch: bool = False) -> PlainProgress | LiveProgress:
    out = out or sys.stdout
    if live is None:
        live = out.isatty()
    cls = LiveProgress if live else PlainProgress
    progress = cls(max_steps=max_steps, start_step=start_step, log_every=log_every, out=out)
    progress.show_epoch = show_epoch  # runs given in train.epochs show the epoch (metrics.jsonl always has it)
    return progress


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class PlainProgress:
    def __init__(self, *, max_steps: int, start_step: int, log_every: int, out: TextIO) -> None:
        self.max_steps, self.start_step, self.log_every, self.out = max_steps, start_step, log_every, out
        self.show_epoch = False
        self.t0 = time.perf_counter()
        self.records: list[dict[str, Any]] = []  # this session's steps (not the ones before a resume)
        self._window_start = 0  # index into records of the first step since the last printed line

    def _first(self, record: dict[str, Any]) -> None:
        if not self.records:  # the clock starts at the first step, not before the demo's "before" decoding
            self.t0 = time.perf_counter() - record["step_time_s"]

    def update(self, record: dict[str, Any]) -> None:
        self._first(record)
        self.records.append(record)
        step = record["step"]
        due = (step == self.start_step + 1 or step % self.log_every == 0 or step == self.max_steps
               or "eval_loss" in record or "eval_reward" in record or record.get("skipped"))
        if due:
            self.show(self._line(self.records[self._window_start:]))
            self._window_start = len(self.records)

    def show(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def eta(self) -> float:
        done = len(self.records)
        return (time.perf_counter() - self.t0) / max(done, 1) * (self.max_steps - self.records[-1]["step"])

    def _line(self, window: list[dict[str, Any]]) -> str:
        r = window[-1]
        # tokens/s over the steps since the last line: one step's figure jitters with the machine's load
        tps = sum(x["tokens"] for x in window) / max(sum(x["step_time_s"] for x in window), 1e-9)
        parts = [f"step {r['step']}/{self.max_steps}"] + ([f"epoch {r['epoch']:.2f}"] if self.show_epoch else [])
        parts.append(f"loss {r['loss']:.4f}")
        if "eval_loss" in r:
            parts.append(f"eval_loss {r['eval_loss']:.4f}")
        parts += reward_parts(r)
        parts += [f"lr {r['lr']:.2e}", f"{tps:,.0f} tokens/s"]
        peaks = [x["peak_mem_bytes"] for x in window if x.get("peak_mem_bytes") is not None]
        if peaks:
            parts.append(f"peak {max(peaks) / GiB:.2f} GiB")
        if r.get("skipped"):
            parts.append("skipped (non-finite)")
        parts.append(f"eta {_duration(self.eta())}")
        return "  ".join(parts)

    def summary(self) -> str:
        if not self.records:
            return "no steps run"
        first, last = self.records[0], self.records[-1]
        tps = sum(x["tokens"] for x in self.records) / max(sum(x["step_time_s"] for x in self.records), 1e-9)
        evals = [x["eval_loss"] for x in self.records if "eval_loss" in x]
        peaks = [x["peak_mem_bytes"] for x in self.records if x.get("peak_mem_bytes") is not None]
        return (f"{'done' if last['step'] == self.max_steps else 'stopped'}: steps {first['step']}-{last['step']} "
                f"of {self.max_steps} in {_duration(time.perf_counter() - self.t0)}, loss {first['loss']:.4f} -> "
                f"{last['loss']:.4f}" + (f", eval_loss {evals[-1]:.4f}" if evals else "") + f", {tps:,.0f} tokens/s"
                + (f", peak {max(peaks) / GiB:.2f} GiB/rank" if peaks else ""))

    def close(self) -> None:
        self.show(self.summary())


class LiveProgress(PlainProgress):
    """A rich progress bar updated every step (transient: the summary line replaces it at the end)."""

    def __init__(self, *, max_steps: int, start_step: int, log_every: int, out: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        super().__init__(max_steps=max_steps, start_step=start_step, log_every=log_every, out=out)
        self.console = Console(file=out, force_terminal=True) if out is not sys.stdout else Console()
        self._bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                             TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console,
                             transient=True)
        self._task = self._bar.add_task("train", total=max_steps, completed=start_step, info="")
        self._bar.start()

    def update(self, record: dict[str, Any]) -> None:
        self._first(record)
        self.records.append(record)
        info = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s"]
        if self.show_epoch:
            info.insert(0, f"epoch {record['epoch']:.2f}")
        if "eval_loss" in record:
            info.insert(1, f"eval {record['eval_loss']:.4f}")
        info[1:1] = reward_parts(record)
        if record.get("peak_mem_bytes") is not None:
            info.append(f"peak {record['peak_mem_bytes'] / GiB:.2f} GiB")
        self._bar.update(self._task, completed=record["step"], info="  ".join(info))

    def show(self, line: str) -> None:
        self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._bar.stop()
        super().close()


class ExportProgress:
    """`export_checkpoint`'s progress callback. Shown only past `min_bytes` (a small model exports in well under a
    second): a transient rich bar on a terminal, else one line per output file written."""

    def __init__(self, *, min_bytes: int = 1 << 30, out: TextIO | None = None, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.min_bytes = min_bytes
        self._bar: Any = None

    def __call__(self, done: int, total: int, file_name: str) -> None:
        if total < self.min_bytes:
            return
        if self.live:
            if self._bar is None:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

                console = Console(file=self.out, force_terminal=True) if self.out is not sys.stdout else Console()
                self._bar = Progress(TextColumn("export"), BarColumn(), DownloadColumn(binary_units=True),
                                     TimeRemainingColumn(), console=console, transient=True)
                self._task = self._bar.add_task("export", total=total)
                self._bar.start()
            self._bar.update(self._task, completed=done)
            if done >= total and file_name:
                self.close()
        elif file_name:
            print(f"export: wrote {file_name} ({done / GiB:.2f} of {total / GiB:.2f} GiB)", file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def reward_parts(record: dict[str, Any]) -> list[str]:
    """DPO steps: reward accuracy on the batch (and on held-out pairs at eval steps). GRPO steps: the sampled
    completions' mean reward and its std, the share of groups that all scored alike (no signal), the mean completion
    length, KL (grpo.beta > 0), the clipped share, generation tokens/s, and the held-out reward at eval steps."""
    parts = [f"reward_acc {record['reward_accuracy']:.2f}"] if "reward_accuracy" in record else []
    if "eval_reward_accuracy" in record:
        parts.append(f"eval_reward_acc {record['eval_reward_accuracy']:.2f}")
    if "reward" in record:
        parts += [f"reward {record['reward']:.3f}±{record['reward_std']:.3f}",
                  f"zero_std {record['frac_reward_zero_std']:.2f}", f"len {record['completions/mean_length']:.1f}"]
        funcs = [k for k in record if k.startswith("rewards/") and k.endswith("/mean")]
        if len(funcs) > 1:  # each function's mean, named by the spec's last path part (a file's name:function)
            parts += [f"{k[8:-5].rsplit('/', 1)[-1]} {record[k]:.3f}" for k in funcs]
        parts += [f"kl {record['kl']:.4f}"] if "kl" in record else []
        parts += [f"clip {record['clip_ratio/region_mean']:.3f}", f"gen {record['gen_tokens_per_s']:,.0f} tok/s"]
    if "eval_reward" in record:
        parts.append(f"eval_reward {record['eval_reward']:.3f}")
    return parts
