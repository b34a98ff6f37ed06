"""Checkpoints: paths.py (torch-free completeness checks), manager.py (DCP save/load), consolidate.py (export).

`CheckpointManager` and `find_resume_dir` load on first use (PEP 562), so that the launcher can import
`shardtune.checkpoint.paths` without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.checkpoint.manager import CheckpointManager, find_resume_dir

__all__ = ["CheckpointManager", "find_resume_dir"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'shardtune.checkpoint' has no attribute {name!r}")
    from shardtune.checkpoint import manager

    return getattr(manager, name)
