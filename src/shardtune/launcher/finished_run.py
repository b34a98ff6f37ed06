"""A run directory's earlier run is never trained over without a word (checked by the launcher under the run lock,
before any worker starts; no torch here).

- A checkpoint there: the run resumes from it (checkpoint/resume_check.py decides whether this recipe may).
- No checkpoint, and the run finished (final/ or summary.json): training again would replace its final/ and
  metrics.jsonl with a repeat of the same run -> exit 2, naming the way on: a new train.output_dir, or
  train.resume=none to start over there on purpose. (A finished run of other data is refused the same way, naming
  the keys: resume_check.check_rerun.)
- No checkpoint, and the run stopped before its end (a killed worker with train.save_every=0): starting over is
  the only way on; one line says so, and what it replaces.
"""
from __future__ import annotations

import sys
from pathlib import Path

from shardtune.checkpoint.resume_check import resume_checkpoint
from shardtune.config.schema import Recipe
from shardtune.errors import UserError

# What a run writes when it ends (trainer/train.py): final/ unless train.save_final=false, summary.json always.
FINISHED_MARKS = ("final", "summary.json")


def check_finished_run(recipe: Recipe) -> None:
    """Exit 2 (UserError) for a finished run without a checkpoint under train.resume=auto; a notice when this launch
    starts over on an earlier run's records."""
    run_dir = Path(recipe.train.output_dir)
    records = [name for name in (*FINISHED_MARKS, "metrics.jsonl") if _written(run_dir / name)]
    if not records or recipe.train.resume not in ("auto", "none") or resume_checkpoint(recipe) is not None:
        return
    shown = ", ".join(f"{name}/" if (run_dir / name).is_dir() else name for name in records)
    finished = any(name in FINISHED_MARKS for name in records)
    if recipe.train.resume == "auto" and finished:
        raise UserError(f"train.output_dir: '{run_dir}' holds a finished run ({shown}) and no checkpoint to resume: "
                        "training again would replace it: use a new train.output_dir, or set train.resume=none to "
                        "start over there")
    if recipe.launch.is_first_node():  # the nodes share the run directory: one notice
        why = "train.resume=none" if recipe.train.resume == "none" else "it left no checkpoint to resume"
        print(f"train.output_dir: '{run_dir}' holds an earlier run ({shown}); starting over at step 0 ({why}): its "
              "records are replaced", file=sys.stderr)


def _written(path: Path) -> bool:
    """A folder, or a non-empty file (an empty metrics.jsonl: a run that stopped before its first step)."""
    return path.is_dir() or (path.is_file() and path.stat().st_size > 0)
