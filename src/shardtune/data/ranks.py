"""The cache in a multi-rank job: global rank 0 builds, every other rank waits, then all map the same entry.

Why global rank 0 and not local rank 0 of each node: `train.output_dir` (where the cache lives by default) must
already be on a filesystem every node sees (checkpoints are written there by all ranks), so one builder is
enough, and N nodes do not tokenize the same data N times at once. It also gives one place to catch bad data:
rank 0 broadcasts its one-line error and every rank raises the same `UserError` (exit 2 everywhere, no rank
left waiting). If `data.cache_dir` points at a node-local disk, a rank that cannot see the entry afterwards
builds its own copy (atomic, so concurrent copies on one node are safe) and warns: correct, only slower.

The wait is a broadcast on a dedicated gloo group whose timeout is `data.prepare_timeout_min` (default 2 h): the
default group's 10-minute timeout is meant for training collectives, and a 1M-row build can take longer.
"""
from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import cache
from shardtune.data.pipeline import TokenizedData, build_data, ensure_entry, open_entries
from shardtune.data.sources import sources
from shardtune.errors import UserError


def prepare_for_ranks(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, seed: int, output_dir: str,
                      rank: int) -> TokenizedData:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build_data(cfg, tok, seed=seed, output_dir=output_dir)
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=cfg.prepare_timeout_min))
    msg: list[tuple[str, Any] | None] = [None]
    failure: BaseException | None = None
    built: list[bool] = []
    if rank == 0:
        try:
            entries = [ensure_entry(src, tok, seed=seed, output_dir=output_dir) for src, _ in sources(cfg)]
            built = [b for _, b in entries]
            msg = [("ok", [str(e) for e, _ in entries])]
        except UserError as e:
            msg, failure = [("error", str(e))], e
        except Exception as e:  # an internal failure: the others stop too instead of waiting for the timeout
            msg, failure = [("crash", f"{type(e).__name__}: {e}")], e
    dist.broadcast_object_list(msg, src=0, group=group)
    dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    kind, payload = msg[0]
    if kind == "error":
        raise UserError(payload)
    if kind == "crash":
        raise RuntimeError(f"rank 0 failed to build the data cache: {payload}")
    entries = []
    for i, (src, _) in enumerate(sources(cfg)):
        entry = Path(payload[i])
        if cache.read_manifest(entry) is None:
            warnings.warn(f"data cache {entry} (built by rank 0) is not visible on this node: building a local copy; "
                          "put data.cache_dir on a filesystem all nodes share", stacklevel=2)
            entries.append(ensure_entry(src, tok, seed=seed, output_dir=output_dir))
        else:
            entries.append((entry, rank == 0 and built[i]))
    return open_entries(cfg, entries, seed=seed)
