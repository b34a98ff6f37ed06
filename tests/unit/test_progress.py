"""Rank 0's progress output (trainer/progress.py): plain lines every train.log_every steps off a terminal, a live display
replaced by a one-line summary on one."""
from __future__ import annotations

import io
import re

from shardtune.config.schema import TrainConfig
from shardtune.trainer.progress import make_progress


def _record(step: int, *, eval_every: int = 0, peak: int | None = None) -> dict:
    r = {"step": step, "loss": 5.0 - step / 100, "lr": 1e-3, "tokens": 2048, "tokens_per_s": 4096.0,
         "step_time_s": 0.5}
    if eval_every and step % eval_every == 0:
        r["eval_loss"] = 4.0
    if peak is not None:
        r["peak_mem_bytes"] = peak
    return r


def _run(max_steps: int, *, start: int = 0, eval_every: int = 0, live: bool = False, peak: int | None = None,
         log_every: int | None = None) -> list[str]:
    out = io.StringIO()
    p = make_progress(max_steps=max_steps, start_step=start, log_every=log_every or TrainConfig().log_every, out=out,
                      live=live)
    for step in range(start + 1, max_steps + 1):
        p.update(_record(step, eval_every=eval_every, peak=peak))
    p.close()
    return out.getvalue().splitlines()


def test_plain_lines_for_the_300_step_demo() -> None:
    """tiny-cpu: 300 steps, eval every 50, default log_every: step 1, every 20th, the 3 evals off the grid."""
    lines = _run(300, eval_every=50)
    steps = [int(m.group(1)) for ln in lines if (m := re.match(r"step (\d+)/300 ", ln))]
    assert steps == sorted({1, *range(20, 301, 20), 50, 150, 250})
    assert 10 <= len(steps) <= 20
    assert "eval_loss 4.0000" in next(ln for ln in lines if ln.startswith("step 50/300"))
    assert "4,096 tokens/s" in lines[0] and "eta" in lines[0]
    assert lines[-1].startswith("done: steps 1-300 of 300") and "loss 4.9900 -> 2.0000" in lines[-1]
    assert len(lines) == len(steps) + 1


def test_plain_lines_after_resume_and_with_peak_memory() -> None:
    lines = _run(50, start=30, log_every=10, peak=3 * 2**30)
    assert [ln.split()[1] for ln in lines[:-1]] == ["31/50", "40/50", "50/50"]
    assert "peak 3.00 GiB" in lines[0] and lines[-1].endswith("peak 3.00 GiB/rank")


def test_live_display_leaves_only_a_summary() -> None:
    out = "\n".join(_run(40, live=True, peak=2**30))
    assert "step 40/40" in out and "loss 4.6000" in out  # the live line was drawn
    after_erase = out.split("\x1b[2K")[-1].strip()  # what is left once the transient bar's line is erased
    assert after_erase.startswith("done: steps 1-40 of 40") and after_erase.endswith("peak 1.00 GiB/rank")
    assert "\n" not in after_erase


def test_export_progress_lines_per_file_only_for_large_exports() -> None:
    from shardtune.trainer.progress import ExportProgress

    out = io.StringIO()
    p = ExportProgress(min_bytes=100, out=out, live=False)
    for done, name in ((40, ""), (80, "model-00001-of-00002.safetensors"), (120, ""),
                       (160, "model-00002-of-00002.safetensors")):
        p(done, 160, name)
    assert [ln.split()[2] for ln in out.getvalue().splitlines()] == ["model-00001-of-00002.safetensors",
                                                                     "model-00002-of-00002.safetensors"]
    small = io.StringIO()
    ExportProgress(min_bytes=1000, out=small, live=False)(160, 160, "model.safetensors")
    assert small.getvalue() == ""
