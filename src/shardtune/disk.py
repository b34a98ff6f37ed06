"""Writing the run's small files whole or not at all, and a full disk as one line.

`write_text_atomic` writes a temp file beside the target, fsyncs it and renames it over the target: a crash or a
full disk leaves the previous file (or none), never an empty or half-written one. `disk_full` finds the "no space
left" (or quota) error inside whatever wrapped it (DCP's CheckpointException holds each rank's exception).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from shardtune.errors import UserError

_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in _FULL:
            raise UserError(no_space_line(path)) from None
        raise UserError(f"cannot write {path}: {e.strerror}: check the folder's permissions") from None


def no_space_line(path: Path | str) -> str:
    return f"no space left on device writing {path}: free some space there, or use another train.output_dir"


def nearly_full(path: Path) -> bool:
    """Under 1 MiB free where `path` is: torch.save's zip writer reports a full disk only as "unexpected pos N vs
    M", with no errno; asked right after the failure, before the partial files are removed."""
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def disk_full(err: BaseException) -> bool:
    """True when `err`, its causes or (DCP) the per-rank failures it carries are a full disk or quota."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if any(os.strerror(code) in str(e) for code in _FULL):  # safetensors' Rust I/O error carries no errno
            return True
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):  # rank -> (exception, its stack)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def check_dir_creatable(path: str | Path, key: str) -> None:
    """UserError when directory `path` (recipe key `key`) cannot be made or written: a file where a folder must go,
    a read-only place. Checked at its first existing ancestor, before anything is created."""
    target = Path(path).absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{key}: '{path}' cannot be a folder: '{probe}' is a file; choose another {key}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}: '{path}' cannot be written: '{probe}' is read-only here; choose another {key}")
