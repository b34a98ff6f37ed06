"""Data: files or built-in tasks -> tokenized rows (pipeline.py) -> global batches (batches.py).

The names are loaded on first use (PEP 562): the recipe loader checks `builtin:` names against `synthetic.py`
without importing torch and transformers through this package, which kept the launcher ~2.5 s slower.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.data.batches import GlobalBatches, MicroBatch
    from shardtune.data.pipeline import TokenizedData, build_data

__all__ = ["GlobalBatches", "MicroBatch", "TokenizedData", "build_data"]
_HOME = {"GlobalBatches": "batches", "MicroBatch": "batches", "TokenizedData": "pipeline", "build_data": "pipeline"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'shardtune.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shardtune.data.{_HOME[name]}"), name)
