"""Documents -> fixed-length rows of `seq_len`, in memory (the reference the cache's per-batch rows match; unit
tests build batches from it directly).

Packing concatenates whole documents into a row; `position_ids` restart at 0 for each document, which is how
HF models (transformers >= 5, sdpa/eager/flash) detect packed sequences and keep attention inside a document.
The first label of every document is masked, so no token is trained to predict across a boundary.
Without packing each document is right-padded (causal attention never looks at the padding).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardtune.data.formats import IGNORE


@dataclass
class Rows:
    input_ids: torch.Tensor  # [num_rows, seq_len] int64
    labels: torch.Tensor  # [num_rows, seq_len] int64, IGNORE where no loss
    position_ids: torch.Tensor  # [num_rows, seq_len] int64, restart per document
    num_truncated: int  # documents cut to seq_len (a counted warning, not an error)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, idx):  # the interface GlobalBatches reads through (rows.PackedRows has the same)
        idx = torch.as_tensor(idx, dtype=torch.long)
        return self.input_ids[idx].numpy(), self.labels[idx].numpy(), self.position_ids[idx].numpy()


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, packing: bool) -> Rows:
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    rows_pos: list[list[int]] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []
    truncated = 0

    def flush() -> None:
        nonlocal cur_ids, cur_labels, cur_pos
        if not cur_ids:
            return
        pad = seq_len - len(cur_ids)
        rows_ids.append(cur_ids + [pad_id] * pad)
        rows_labels.append(cur_labels + [IGNORE] * pad)
        rows_pos.append(cur_pos + list(range(pad)))  # padding is its own "document"
        cur_ids, cur_labels, cur_pos = [], [], []

    for ids, labels in docs:
        if len(ids) > seq_len:
            ids, labels = ids[:seq_len], labels[:seq_len]
            truncated += 1
        if not packing or len(cur_ids) + len(ids) > seq_len:
            flush()
        labels = [IGNORE] + labels[1:]  # never predict a document's first token from the previous one
        cur_ids += ids
        cur_labels += labels
        cur_pos += list(range(len(ids)))
    flush()
    if not rows_ids:
        empty = torch.empty(0, seq_len, dtype=torch.long)
        return Rows(empty, empty.clone(), empty.clone(), truncated)
    return Rows(torch.tensor(rows_ids), torch.tensor(rows_labels), torch.tensor(rows_pos), truncated)


DocLengths = tuple[tuple[int, ...], ...]  # per row, the lengths of its documents in order (sum = seq_len)


def doc_lengths(position_ids: np.ndarray | torch.Tensor) -> DocLengths:
    """The documents of each row: a new one starts wherever the position id does not continue the previous one
    (packing restarts them at 0; a row's padding is its own document)."""
    pos = np.asarray(position_ids)
    assert pos.ndim == 2, "[rows, seq_len] position ids"
    rows = []
    for row in pos:
        starts = np.concatenate([[0], np.flatnonzero(np.diff(row) != 1) + 1])
        rows.append(tuple(int(n) for n in np.diff(np.append(starts, len(row)))))
    return tuple(rows)
