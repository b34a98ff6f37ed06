"""Several datasets as one row source, mixed by weight (`data.path: [{path, weight}, ...]`).

Weights are shares of training rows (seq_len tokens each; documents of two datasets never share a row). One
"epoch" of the mix is as many rows as the datasets have together, with dataset k taking a weight-proportional
count n_k of them. The n_k slots of each dataset are spread evenly over the epoch (slot m of k at time
(m + 0.5) / n_k, all slots sorted by time), so any window of consecutive rows, a global batch included, holds each
dataset's share within one row. The rows a dataset contributes walk through a seeded permutation of its own rows,
a fresh one each time it has been used up: an up-weighted small dataset repeats only after all its rows were seen.

`MixedRows` is `ordered`: `GlobalBatches` reads it in order instead of permuting it (a random permutation would
make a 1,000-row window's share vary by ~1.5 points), and everything is a pure function of (seed, position), so the
global batch of a step is the same at any world size and after a resume.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shardtune.data.batches import RowSource, epoch_permutation


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainder), at least one row each."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    exact = w * total
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    for k in np.argsort(-(exact - np.floor(exact)), kind="stable")[: max(0, total - int(counts.sum()))]:
        counts[k] += 1
    return counts.tolist()


class MixedRows:
    ordered = True  # read in order by GlobalBatches: the interleave is the mix's shuffle

    def __init__(self, parts: list[RowSource], weights: list[float], *, seed: int) -> None:
        assert len(parts) == len(weights) and all(len(p) > 0 for p in parts)
        self.parts = parts
        self.lengths = [len(p) for p in parts]
        self.counts = apportion(sum(self.lengths), weights)  # rows of each dataset per mix epoch
        slot_time = np.concatenate([(np.arange(n) + 0.5) / n for n in self.counts])
        part = np.concatenate([np.full(n, k, dtype=np.int32) for k, n in enumerate(self.counts)])
        slot = np.concatenate([np.arange(n, dtype=np.int64) for n in self.counts])
        order = np.lexsort((part, slot_time))  # by time, ties by dataset index: deterministic
        self.part, self.slot = part[order], slot[order]  # [epoch rows] dataset of each position, its slot number
        self.seed = seed
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.part)

    def locate(self, idx: Any) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, row within it) of each position; positions past the first epoch continue the walk."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        epoch, pos = np.divmod(idx, len(self))
        part = self.part[pos]
        used = epoch * np.asarray(self.counts)[part] + self.slot[pos]  # how many rows of `part` came before
        rows = np.empty_like(idx)
        for i, (k, u) in enumerate(zip(part.tolist(), used.tolist())):
            cycle, j = divmod(u, self.lengths[k])
            rows[i] = self._perm(k, cycle)[j]
        return part, rows

    def _perm(self, k: int, cycle: int) -> np.ndarray:
        key = (k, cycle)
        if key not in self._perms:
            if len(self._perms) >= 4 * len(self.parts):
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = epoch_permutation(self.seed * 1000 + k, cycle, self.lengths[k])
        return self._perms[key]

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _gather(self.parts, *self.locate(idx))


class ConcatRows:
    """Several row sources one after the other (the eval splits of a mix: eval_loss covers each dataset)."""

    def __init__(self, parts: list[RowSource]) -> None:
        self.parts = [p for p in parts if len(p) > 0]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        part = np.searchsorted(self.starts, idx, side="right") - 1
        return _gather(self.parts, part, idx - self.starts[part])


def _gather(parts: list[RowSource], part: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows `rows[i]` of `parts[part[i]]`, in the order given: one `take` per source."""
    out: tuple[np.ndarray, ...] = ()
    for k in np.unique(part).tolist():
        sel = np.nonzero(part == k)[0]
        got = parts[k].take(rows[sel])
        if not out:
            out = tuple(np.empty((len(part), *g.shape[1:]), dtype=g.dtype) for g in got)
        for o, g in zip(out, got):
            o[sel] = g
    return out
