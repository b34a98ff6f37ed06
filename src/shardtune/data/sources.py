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

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardtune.config.data_keys import ENTRY_KEYS
from shardtune.hub import is_hub_id

if TYPE_CHECKING:
    from shardtune.config.schema import DataConfig

def sources(cfg: DataConfig) -> list[tuple[DataConfig, float]]:
    """(one dataset's DataConfig with a string path, its weight) for each dataset of `data.path`. A Hub dataset id
    reads as the saved folder of its split (data/hub_data.py: fetched and saved on first use)."""
    if not isinstance(cfg.path, (list, tuple)):
        return [(_local(cfg), 1.0)]
    out = []
    for entry in cfg.path:
        fields: dict[str, Any] = {k: v for k, v in entry.items() if k in ENTRY_KEYS}
        out.append((_local(replace(cfg, path=str(entry["path"]), **fields)), float(entry.get("weight", 1))))
    return out


def _local(cfg: DataConfig) -> DataConfig:
    if not isinstance(cfg.path, str) or not is_hub_id(cfg.path):
        if cfg.subset is not None:
            warnings.warn(f"data.subset={cfg.subset} is ignored: it picks a subset of a Hub dataset id, and "
                          f"data.path '{cfg.path}' is not one", stacklevel=3)
        return cfg
    from shardtune.data.hub_data import saved_split

    return replace(cfg, path=str(saved_split(cfg.path, cfg.split, cfg.subset)))


def is_mix(cfg: DataConfig) -> bool:
    return isinstance(cfg.path, (list, tuple))
