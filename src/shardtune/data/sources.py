"""`data.path` as one dataset or a weighted list of them: each becomes a `DataConfig` with one string path.

    data:
      format: instruction            # the default of every entry
      path:
        - {path: alpaca.jsonl, weight: 3, template: alpaca}
        - {path: chats.jsonl, weight: 1, format: chat}

An entry may set `path` (required), `weight` (default 1) and any per-dataset key below; the rest comes from
`data.*`. Each dataset gets its own cache entry (a mix shares entries with the runs that use its parts alone).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardtune.config.data_keys import ENTRY_KEYS

if TYPE_CHECKING:
    from shardtune.config.schema import DataConfig

def sources(cfg: DataConfig) -> list[tuple[DataConfig, float]]:
    """(one dataset's DataConfig with a string path, its weight) for each dataset of `data.path`."""
    if not isinstance(cfg.path, (list, tuple)):
        return [(cfg, 1.0)]
    out = []
    for entry in cfg.path:
        fields: dict[str, Any] = {k: v for k, v in entry.items() if k in ENTRY_KEYS}
        out.append((replace(cfg, path=str(entry["path"]), **fields), float(entry.get("weight", 1))))
    return out


def is_mix(cfg: DataConfig) -> bool:
    return isinstance(cfg.path, (list, tuple))
