"""What makes a checkpoint folder complete. No torch here: the launcher and `shardtune validate` check an explicit
`train.resume` path before any worker starts (a typo then costs half a second, not a worker start-up)."""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError

TRAINER_FILE = "trainer.json"  # written last: its presence marks a complete checkpoint


def is_complete(d: Path) -> bool:
    return (d / TRAINER_FILE).is_file()


def require_complete(d: str | Path, key: str, fix: str) -> Path:
    """`d` as a Path, or a one-line UserError naming `key` when it is not a complete checkpoint."""
    d = Path(d)
    if not is_complete(d):
        raise UserError(f"{key}: '{d}' is not a complete checkpoint (no {TRAINER_FILE}): {fix}")
    return d


def explicit_resume_dir(resume: str) -> Path | None:
    """`train.resume` when it names a folder (not auto/none): that folder, checked."""
    if resume in ("auto", "none"):
        return None
    return require_complete(resume, "train.resume", "point it at checkpoints/step_N or use train.resume=auto")
