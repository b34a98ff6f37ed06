"""`data.format: preference`: rows {prompt, chosen, rejected} -> pairs of documents in the same Arrow cache.

Rows are encoded and truncated by pair_encoding.py. Pair p is stored as documents 2p (prompt +
chosen) and 2p + 1 (prompt + rejected), never packed: a split's rows are its pairs' documents in order, so row 2k is
the chosen and row 2k + 1 the rejected of the split's k-th pair. Prompt tokens are masked (IGNORE).

Pairs whose chosen equals their rejected teach nothing (their log-ratio difference is 0): they are dropped,
counted in the manifest and warned about.
"""
from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import docs as store
from shardtune.data.batches import GlobalBatches, MicroBatch
from shardtune.data.fields import resolve_fields
from shardtune.data.pair_encoding import encode_pair, truncate_pair
from shardtune.data.tokens import IGNORE
from shardtune.errors import UserError


@dataclass
class _Encoded:
    docs: list[tuple[list[int], list[int]]]  # 2 per kept pair: chosen, rejected
    kept: list[int]  # source row of each kept pair
    identical: int
    truncated: list[bool]  # per kept pair


def _encode(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase) -> _Encoded:
    out = _Encoded([], [], 0, [])
    for i in range(len(raw)):
        row = raw[i]
        for key in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field):
            if key and row.get(key) is None:
                raise UserError(f"data.path: row {i} has no '{key}': every preference row needs "
                                f"{cfg.prompt_field}, {cfg.chosen_field} and {cfg.rejected_field} (set data.*_field "
                                "to remap column names)")
        if row[cfg.chosen_field] == row[cfg.rejected_field]:
            out.identical += 1
            continue
        p, c, r, cut = truncate_pair(*encode_pair(row, cfg, tok), cfg.seq_len)
        if c == r:  # different texts, the same tokens once cut to data.seq_len: nothing to prefer
            out.identical += 1
            continue
        for resp in (c, r):
            out.docs.append((p + resp, [IGNORE] * len(p) + resp))
        out.kept.append(i)
        out.truncated.append(cut)
    return out


def build_pair_entry(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase, tmp: Path, *, seed: int,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The preference layout: pairs as two unpacked documents each, in the same store and manifest as packed rows
    (data/docs.py), plus `pairs` counts."""
    cfg = resolve_fields(cfg, list(raw[0]) if isinstance(raw, list) else raw.column_names)
    dtype = store.token_dtype(tok)
    enc = _encode(raw, cfg, tok)
    if progress is not None:
        progress(len(raw), len(raw))
    if enc.identical:
        warnings.warn(f"data: {enc.identical} preference rows have chosen identical to rejected (as written, or "
                      f"once truncated to data.seq_len={cfg.seq_len}); they were dropped", stacklevel=2)
    n = len(enc.kept)
    if n == 0:
        raise UserError(f"data.path: no usable preference pairs in '{cfg.path}' (every row's chosen equals its "
                        "rejected?)")
    tables = [store.docs_table(enc.docs[a : a + store.BATCH_ROWS], seq_len=cfg.seq_len, dtype=dtype)
              for a in range(0, len(enc.docs), store.BATCH_ROWS)]
    import pyarrow as pa

    table = pa.concat_tables(tables)
    files = [store.write_docs(table, tmp)]
    order = list(range(n))
    random.Random(seed).shuffle(order)
    num_eval = int(n * cfg.eval_fraction)
    lengths = store.int_column(table, "length")  # the documents are cut to seq_len already
    targets = store.int_column(table, "num_targets")
    stats: dict[str, Any] = {}
    for split, pairs in (("train", order[num_eval:]), ("eval", order[:num_eval])):
        pairs_arr = np.array(pairs, dtype=np.int64)
        ids = np.stack([2 * pairs_arr, 2 * pairs_arr + 1], axis=1).reshape(-1)
        np.save(tmp / f"{split}_docs.npy", ids)
        np.save(tmp / f"{split}_rows.npy", np.arange(len(ids) + 1, dtype=np.int64))
        stats[split] = {"rows": len(ids), "documents": len(ids), "pairs": len(pairs),
                        "tokens": int(lengths[ids].sum()), "target_tokens": int(targets[ids].sum()),
                        "truncated": int(sum(enc.truncated[p] for p in pairs))}
    if stats["train"]["pairs"] == 0:
        raise UserError(f"data.path: no training pairs left in '{cfg.path}': lower data.eval_fraction")
    if stats["train"]["truncated"]:
        warnings.warn(f"{stats['train']['truncated']} preference pairs longer than data.seq_len={cfg.seq_len} were "
                      "truncated (prompt keeps its end, responses their start)", stacklevel=2)
    with open(tmp / "eval_raw.jsonl", "w") as f:
        for p in order[:num_eval][:store.EVAL_RAW_KEEP]:
            f.write(json.dumps(raw[enc.kept[p]], default=str) + "\n")
    return store.manifest(cfg, tok, files=files, dtype=dtype, source_rows=len(raw), num_eval_raw=num_eval, stats=stats,
                    lengths=lengths, packing=False, identical_pairs=enc.identical)


@dataclass
class PairMicroBatch(MicroBatch):
    """2b rows: the b chosen documents, then the b rejected ones, in the same pair order."""

    pair_ids: np.ndarray  # [b] int64, indices of the pairs in their split (reference log-prob lookup)


class PairRows:
    """A split's rows seen as pairs: take(pairs) -> the chosen rows, then the rejected rows."""

    def __init__(self, rows: Any) -> None:
        assert len(rows) % 2 == 0, "a preference split holds two rows per pair"
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // 2

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return self.rows.take(np.concatenate([2 * idx, 2 * idx + 1]))

    def micro_batch(self, idx: Any) -> PairMicroBatch:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return PairMicroBatch(*(torch.from_numpy(x) for x in self.take(idx)), pair_ids=idx)


class PairBatches(GlobalBatches):
    """GlobalBatches over pairs: the same world-size-free order (step k = pairs [kG, (k+1)G) of the seeded
    permutation), a micro-batch is b whole pairs (2b rows), and the loss is normalised by the G pairs of the
    global batch. Each rank reads only its own pairs."""

    def __init__(self, rows: Any, **kwargs: Any) -> None:
        super().__init__(PairRows(rows), **kwargs)

    def step(self, step: int, rank: int) -> tuple[list[MicroBatch], int]:
        idx = self.indices(step)
        micro: list[MicroBatch] = []
        for a in range(self.accum):
            lo = (a * self.world + rank) * self.b
            micro.append(self.rows.micro_batch(idx[lo : lo + self.b]))
        return micro, self.global_size
