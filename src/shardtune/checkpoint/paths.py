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


def newest_complete(root: Path) -> Path | None:
    """The checkpoint `root/latest` names when complete, else the newest complete `step_N` (None: none yet)."""
    if not root.is_dir():
        return None
    latest = root / "latest"
    if latest.is_file():
        d = root / latest.read_text().strip()
        if is_complete(d):
            return d
    done = sorted((d for d in root.glob("step_*") if is_complete(d)), key=lambda d: int(d.name.split("_")[1]))
    return done[-1] if done else None


def explicit_resume_dir(resume: str) -> Path | None:
    """`train.resume` when it names a folder (not auto/force/none): that folder, checked."""
    if resume in ("auto", "force", "none"):
        return None
    return require_complete(resume, "train.resume", "point it at checkpoints/step_N or use train.resume=auto")


def latest_checkpoint(ckpt: Path) -> Path:
    """A checkpoints/ folder -> its newest complete checkpoint; a step_N folder as is (checked)."""
    if (ckpt / "latest").is_file():
        ckpt = ckpt / (ckpt / "latest").read_text().strip()
    return require_complete(ckpt, "export", "point it at <output_dir>/checkpoints/step_N")


def prepare_target(out: Path, *, force: bool) -> None:
    """Export never overwrites by accident: a non-empty target needs --force. With it, the model files of an
    earlier export there are removed first, so no stale shard of another model is left beside the new ones."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"export: '{out}' is a file: give a folder to write the model into")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not force:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"export: '{out}' is not empty ({shown}): choose a new folder, or add --force to "
                        "overwrite the model there")
    for p in out.iterdir():
        if p.is_file() and (p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")):
            p.unlink()
