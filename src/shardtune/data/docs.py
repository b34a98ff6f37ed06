"""The cache's document store, shared by every format's builder (packed SFT rows, preference pairs): tokenized
documents as Arrow IPC stream files (input_ids, a boolean target mask, length, num_targets), the helpers that read
their columns back, what a builder hands to the entry writer (build.py), and the manifest every entry writes."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from shardtune.config.data_keys import ENTRY_KEYS
from shardtune.config.schema import DataConfig
from shardtune.data.rows import buffer_view
from shardtune.data.tokens import IGNORE

BATCH_ROWS = 1000  # rows per tokenizer call
EVAL_RAW_KEEP = 1024  # raw held-out rows kept for the demo's exact-match check (train.demo_eval_samples <= this)
HIST_EDGES = (0.125, 0.25, 0.5, 1.0)  # document length histogram bins, as fractions of seq_len


@dataclass
class Documents:
    """A format's rows, encoded and written into the store: what the entry writer splits and lays out."""

    files: list[str]  # Arrow IPC stream files in the temp dir
    table: pa.Table  # their documents, memory-mapped
    length: np.ndarray  # [documents] int64, tokens before truncation
    num_targets: np.ndarray  # [documents] int64
    num_units: int  # what the held-out split draws from: source rows (SFT) or kept pairs (preference)


def documents(files: list[str], table: pa.Table, *, num_units: int) -> Documents:
    return Documents(files, table, int_column(table, "length"), int_column(table, "num_targets"), num_units)


@dataclass
class Layout:
    """One split of an entry: its rows as runs of documents, saved as `{split}_docs.npy` / `_rows.npy` /
    `_starts.npy` (what rows.py maps), and the counts the manifest records for it."""

    docs: np.ndarray  # [pieces] document ids in row order, int32 or int64
    rows: np.ndarray  # [rows + 1] int64, row r = docs[rows[r]:rows[r + 1]]
    stats: dict[str, int]
    starts: np.ndarray | None = None  # [pieces] int64, data.long_docs=split: each piece's first token


def token_dtype(tok: PreTrainedTokenizerBase) -> str:
    return "uint16" if len(tok) <= 2**16 else "int32"


def write_docs(docs: pa.Table, tmp: Path, name: str = "docs-00000.arrow") -> str:
    """One Arrow IPC stream file of documents, the format rows.py maps."""
    with pa.OSFile(str(tmp / name), "wb") as sink, pa.ipc.new_stream(sink, docs.schema) as writer:
        writer.write_table(docs)
    return name


def docs_table(docs: list[tuple[list[int], list[int]]], *, seq_len: int, dtype: str) -> pa.Table:
    """(ids, labels) documents -> the cache's Arrow table (input_ids, target, length, num_targets)."""
    length = np.fromiter((len(ids) for ids, _ in docs), dtype=np.int64, count=len(docs))
    kept = np.minimum(length, seq_len)
    total = int(kept.sum())
    flat_ids = np.fromiter(itertools.chain.from_iterable(ids[:seq_len] for ids, _ in docs), dtype=dtype,
                           count=total)
    target = np.fromiter(itertools.chain.from_iterable(lab[:seq_len] for _, lab in docs), dtype=np.int64,
                         count=total) != IGNORE
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(kept, out=offsets[1:])
    target[offsets[:-1][kept > 0]] = False
    cum = np.concatenate([[0], np.cumsum(target)])
    num_targets = cum[offsets[1:]] - cum[offsets[:-1]]
    assert total < 2**31, "a 1,000-row batch cut to seq_len fits int32 offsets"
    off = _arrow(offsets.astype(np.int32))
    return pa.table({"input_ids": pa.ListArray.from_arrays(off, _arrow(flat_ids)),
                     "target": pa.ListArray.from_arrays(off, _arrow(target)),
                     "length": _arrow(length.astype(np.int32)), "num_targets": _arrow(num_targets.astype(np.int32))})


# numpy <-> Arrow through the buffers: `pa.array(ndarray)` and `Array.to_numpy()` import pandas (~0.2 s), which a
# builtin-task build and the training ranks otherwise never need.
_ARROW_TYPES = {np.dtype(np.uint16): pa.uint16(), np.dtype(np.int32): pa.int32(), np.dtype(np.bool_): pa.bool_()}


def _arrow(x: np.ndarray) -> pa.Array:
    """A 1D numpy array as an Arrow array without nulls (booleans bit-packed, LSB first, as Arrow stores them)."""
    data = np.packbits(x, bitorder="little") if x.dtype == np.bool_ else np.ascontiguousarray(x)
    return pa.Array.from_buffers(_ARROW_TYPES[x.dtype], len(x), [None, pa.py_buffer(data)])


def length_histogram(length: np.ndarray, seq_len: int) -> dict[str, list[int]]:
    """Document lengths (before truncation; 0 = nothing to learn, left out) in HIST_EDGES bins of seq_len."""
    edges = [0] + [int(f * seq_len) for f in HIST_EDGES] + [max(int(length.max()), seq_len) + 1]
    counts, _ = np.histogram(length[length > 0], bins=edges)
    return {"edges": edges, "counts": counts.tolist()}


def int_column(table: pa.Table, name: str) -> np.ndarray:
    chunks = [buffer_view(c, np.int32) for c in table.column(name).chunks]
    return np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, dtype=np.int64)


def manifest(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, files: list[str], dtype: str, source_rows: int,
             num_eval_raw: int, stats: dict[str, Any], lengths: np.ndarray, packing: bool,
             **extra: Any) -> dict[str, Any]:
    """The entry's manifest.json: what `open_entry` needs to map the files, and the stats `prepare` reports."""
    return {"files": files, "token_dtype": dtype, "seq_len": cfg.seq_len, "packing": packing,
            "pad_id": tok.pad_token_id if tok.pad_token_id is not None else 0, "source_rows": source_rows,
            "num_eval_raw": int(num_eval_raw), "stats": stats, "histogram": length_histogram(lengths, cfg.seq_len),
            "data": {k: getattr(cfg, k) for k in ENTRY_KEYS}, **extra}  # the resolved fields (demo, report)
