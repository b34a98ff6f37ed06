"""`data.format: preference`: rows {prompt, chosen, rejected} -> pairs of documents in the same Arrow cache.

Rows are encoded and truncated by pair_encoding.py. Pair p is stored as documents 2p (prompt +
chosen) and 2p + 1 (prompt + rejected), never packed: a split's rows are its pairs' documents in order, so row 2k is
the chosen and row 2k + 1 the rejected of the split's k-th pair. Prompt tokens are masked (IGNORE).

Pairs whose chosen equals their rejected teach nothing (their log-ratio difference is 0): they are dropped,
counted in the manifest and warned about.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import docs as store
from shardtune.data.batches import GlobalBatches, MicroBatch
from shardtune.data.pair_encoding import Encoded, encode_pair, ignored_template, truncate_pair
from shardtune.data.tokens import IGNORE
from shardtune.errors import UserError


class PairBuilder:
    """The preference builder for build.py's entry writer: a unit is a kept pair, stored as two unpacked documents
    in the same store and manifest as packed rows (data/docs.py), plus `pairs` counts."""

    def __init__(self, cfg: DataConfig, tok: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tok = cfg, tok
        self.kept: list[int] = []  # source row of each kept pair
        self.truncated = np.zeros(0, dtype=bool)  # per kept pair
        self.identical = 0  # rows dropped: chosen equals rejected

    def encode(self, raw: Any, dtype: str, tmp: Path, progress: Callable[[int, int], None] | None) -> store.Documents:
        cfg = self.cfg
        docs: Encoded = []  # 2 per kept pair: chosen, rejected
        truncated = []
        if len(raw) and ignored_template(raw[0], cfg):
            warnings.warn(ignored_template(raw[0], cfg), stacklevel=2)
        for i in range(len(raw)):
            pair = self._encode_row(raw[i], i)
            if pair is not None:
                docs += pair[0]
                self.kept.append(i)
                truncated.append(pair[1])
        if progress is not None:
            progress(len(raw), len(raw))
        if self.identical:
            warnings.warn(f"data: {self.identical} preference rows have chosen identical to rejected (as written, or "
                          f"once truncated to data.seq_len={cfg.seq_len}); they were dropped", stacklevel=2)
        if not self.kept:
            raise UserError(f"data.path: no usable preference pairs in '{cfg.path}' (every row's chosen equals its "
                            "rejected?)")
        self.truncated = np.array(truncated, dtype=bool)
        table = pa.concat_tables([store.docs_table(docs[a : a + store.BATCH_ROWS], seq_len=cfg.seq_len, dtype=dtype)
                                  for a in range(0, len(docs), store.BATCH_ROWS)])
        return store.documents([store.write_docs(table, tmp)], table, num_units=len(self.kept))

    def _encode_row(self, row: dict[str, Any], i: int) -> tuple[Encoded, bool] | None:
        """Row i -> its two documents (prompt masked) and whether it was truncated; None when there is nothing to
        prefer (counted in `identical`)."""
        cfg = self.cfg
        for key in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field):
            if key and row.get(key) is None:
                raise UserError(f"data.path: row {i} has no '{key}': every preference row needs "
                                f"{cfg.prompt_field}, {cfg.chosen_field} and {cfg.rejected_field} (set data.*_field "
                                "to remap column names)")
        if row[cfg.chosen_field] == row[cfg.rejected_field]:
            self.identical += 1
            return None
        p, c, r, cut = truncate_pair(*encode_pair(row, cfg, self.tok), cfg.seq_len)
        if c == r:  # different texts, the same tokens once cut to data.seq_len: nothing to prefer
            self.identical += 1
            return None
        return [(p + resp, [IGNORE] * len(p) + resp) for resp in (c, r)], cut

    def lay_out(self, docs: store.Documents, units: np.ndarray) -> store.Layout:
        """Pair p is documents 2p (chosen) and 2p + 1 (rejected); each document is a row of its own."""
        ids = np.stack([2 * units, 2 * units + 1], axis=1).reshape(-1)
        stats = {"rows": len(ids), "documents": len(ids), "pairs": len(units),
                 "tokens": int(docs.length[ids].sum()),  # the documents are cut to seq_len already
                 "target_tokens": int(docs.num_targets[ids].sum()), "truncated": int(self.truncated[units].sum())}
        return store.Layout(ids, np.arange(len(ids) + 1, dtype=np.int64), stats)

    def check(self, stats: dict[str, Any]) -> None:
        cfg, train = self.cfg, stats["train"]
        if train["pairs"] == 0:
            raise UserError(f"data.path: no training pairs left in '{cfg.path}': lower data.eval_fraction")
        if train["truncated"]:
            warnings.warn(f"{train['truncated']} preference pairs longer than data.seq_len={cfg.seq_len} were "
                          "truncated (prompt keeps its end, responses their start)", stacklevel=2)

    def source_row(self, unit: int) -> int:
        return self.kept[unit]

    def manifest_fields(self) -> dict[str, Any]:
        return {"packing": False, "identical_pairs": self.identical}


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
