"""A memory-mapped split of a cache entry: `take(row_indices)` -> padded numpy rows of seq_len.

Nothing is read up front: the Arrow documents and the two layout arrays are memory maps, so a rank's resident
data memory is the pages it has touched (shared with the other ranks of the node through the page cache), and
no torch tensor holds the dataset (the CPU memory tracker counts tensors only). A batch costs one Arrow `take`
of its documents plus a Python loop over them: microseconds per row, once per step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardtune.data.formats import IGNORE


def open_documents(entry: Path, files: list[str]) -> pa.Table:
    """The tokenized documents of every piece as one table of memory-mapped chunks (no copy). The files are the
    Arrow IPC streams `datasets.map` wrote; pyarrow reads them directly, so a cache hit never imports `datasets`
    (~1-2 s)."""
    tables = [pa.ipc.open_stream(pa.memory_map(str(entry / f))).read_all() for f in files]
    return pa.concat_tables(tables).select(["input_ids", "target"])


class PackedRows:
    """One split (train or eval). Row r = documents docs[rows[r]:rows[r+1]] back to back, then padding."""

    def __init__(self, entry: Path, split: str, documents: pa.Table, manifest: dict[str, Any]) -> None:
        self.docs = np.load(entry / f"{split}_docs.npy", mmap_mode="r")  # [num_docs] document ids, in order
        self.rows = np.load(entry / f"{split}_rows.npy", mmap_mode="r")  # [num_rows + 1] offsets into docs
        # data.long_docs=split: docs[j] is a piece of its document, starting at token starts[j] (build.split_pieces)
        starts = entry / f"{split}_starts.npy"
        self.starts = np.load(starts, mmap_mode="r") if starts.is_file() else None
        self.documents = documents
        # Per-chunk access: `ChunkedArray.take` on list columns concatenates the chunks first, i.e. copies the whole
        # column into anonymous memory at every step (RSS growing with the dataset). One document at a time from
        # its own chunk copies only that document.
        self._ids = [_ListView(c) for c in documents.column("input_ids").chunks]
        self._target = [_ListView(c) for c in documents.column("target").chunks]
        self._starts = np.cumsum([0] + [len(c) for c in self._ids])  # first document id of each chunk
        self.seq_len: int = manifest["seq_len"]
        self.pad_id: int = manifest["pad_id"]
        self.num_truncated: int = manifest["stats"][split]["truncated"]

    def __len__(self) -> int:
        return len(self.rows) - 1

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """input_ids, labels (IGNORE where no loss), position_ids: int64 [len(idx), seq_len]. Position ids restart
        at 0 per document (and for the padding), which keeps attention inside a packed document."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        spans = [(int(self.rows[r]), int(self.rows[r + 1])) for r in idx]
        docs = []  # (ids, target) per document, numpy views/copies of one document each
        s = self.seq_len
        for a, b in spans:
            for j in range(a, b):
                d = self.docs[j]
                c = int(np.searchsorted(self._starts, d, side="right")) - 1
                i = int(d) - int(self._starts[c])
                lo = 0 if self.starts is None else int(self.starts[j])
                toks, target = self._ids[c].get(i, lo, lo + s).astype(np.int64), self._target[c].get(i, lo, lo + s)
                if lo:
                    target[0] = False  # the previous piece's last token: context here, trained on there
                docs.append((toks, target))
        n = len(idx)
        input_ids = np.full((n, s), self.pad_id, dtype=np.int64)
        labels = np.full((n, s), IGNORE, dtype=np.int64)
        positions = np.zeros((n, s), dtype=np.int64)
        d = 0  # next document of `docs`
        for i, (a, b) in enumerate(spans):
            col = 0
            for _ in range(b - a):
                toks, target = docs[d]
                k = len(toks)
                input_ids[i, col : col + k] = toks
                labels[i, col : col + k] = np.where(target, toks, IGNORE)
                positions[i, col : col + k] = np.arange(k)
                col, d = col + k, d + 1
            positions[i, col:] = np.arange(s - col)  # padding is its own "document"
        return input_ids, labels, positions


class _ListView:
    """One chunk of a list<uint16 | int32 | bool> column as numpy views of its memory-mapped Arrow buffers (offsets
    and flat values; the booleans stay bit-packed): `get(i)` copies document i only. Read through the buffers,
    not `Array.to_numpy`, which imports pandas (~0.2 s per rank on the first batch) for a non-zero-copy array."""

    def __init__(self, chunk: pa.ListArray) -> None:
        assert chunk.null_count == 0, "the cache writes no null documents"
        offsets = chunk.offsets  # int32, this chunk's slice (length + 1), indexing into `chunk.values`
        self._offsets = buffer_view(offsets, np.int32)
        values = chunk.values
        self._bits = pa.types.is_boolean(values.type)
        if self._bits:  # LSB-first bitmap; bit k of the values array is bit (values.offset + k) of the buffer
            self._base = values.offset
            self._data = np.frombuffer(values.buffers()[1], dtype=np.uint8)
        else:
            self._data = buffer_view(values, np.dtype(values.type.to_pandas_dtype()))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, i: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Document i, or its tokens [lo, hi)."""
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        a, b = a + lo, b if hi is None else min(b, a + hi)
        if not self._bits:
            return np.array(self._data[a:b])
        a, b = a + self._base, b + self._base
        bits = np.unpackbits(self._data[a // 8 : (b + 7) // 8], bitorder="little")
        return bits[a % 8 : a % 8 + (b - a)].astype(bool)


def buffer_view(arr: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A primitive, null-free Arrow array as a zero-copy numpy view (honours the array's slice offset)."""
    assert arr.null_count == 0
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr)]
