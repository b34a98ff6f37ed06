"""World-size-independent global batches.

Step k uses rows [k*G, (k+1)*G) of a seeded permutation (a fresh permutation per epoch), G = micro_batch_size *
world_size * grad_accum. Inside the step, rank r at micro-step a takes the b rows at offset (a*W + r)*b. So W
workers x A micro-steps and W' x A' with W*A = W'*A' train on exactly the same rows per optimizer step, and the
loss of each micro-batch is divided by the target-token count of the whole global batch (every rank can count
it locally: all ranks index the same rows), which makes the summed gradient equal to single-device training.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from shardtune.accelerator import to_device
from shardtune.data.formats import IGNORE
from shardtune.data.packing import DocLengths, doc_lengths


class RowSource(Protocol):
    """What batches read: the cache's memory-mapped `rows.PackedRows`, or the in-memory `packing.Rows`."""

    def __len__(self) -> int: ...

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, seq_len] int64
    labels: torch.Tensor  # [b, seq_len] int64
    position_ids: torch.Tensor  # [b, seq_len] int64
    # each row's document lengths, read from the host position ids (model/attention.py: no device sync to find them)
    doc_lengths: DocLengths | None = field(default=None, kw_only=True)

    def to(self, device: torch.device) -> MicroBatch:
        """On the device without a host sync (pinned, non-blocking: accelerator.to_device)."""
        return replace(self, input_ids=to_device(self.input_ids, device), labels=to_device(self.labels, device),
                       position_ids=to_device(self.position_ids, device))


def num_targets(labels: torch.Tensor | np.ndarray) -> int:
    """Tokens that carry a loss after the causal shift (position t predicts label t+1)."""
    return int((labels[:, 1:] != IGNORE).sum())


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The row order of one epoch: a pure function of (seed, epoch, n). numpy, not torch: 8 bytes per row that
    the CPU memory tracker (live tensors) must not count as training memory."""
    return np.random.default_rng([seed, epoch]).permutation(n)


class GlobalBatches:
    def __init__(self, rows: RowSource, *, micro_batch_size: int, grad_accum: int, world_size: int,
                 seed: int) -> None:
        self.rows = rows
        self.b = micro_batch_size
        self.accum = grad_accum
        self.world = world_size
        self.seed = seed
        self.global_size = micro_batch_size * grad_accum * world_size
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs: keep two, not all
                self._perms.pop(min(self._perms))
            self._perms[epoch] = epoch_permutation(self.seed, epoch, len(self.rows))
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """The G row indices of optimizer step `step` (0-based); wraps into the next epoch as needed."""
        n = len(self.rows)
        pos = np.arange(step * self.global_size, (step + 1) * self.global_size)
        if getattr(self.rows, "ordered", False):  # a weighted mix (mix.py): its own shuffle, any position valid
            return pos
        return np.array([self._perm(int(p // n))[p % n] for p in pos], dtype=np.int64)

    def step(self, step: int, rank: int) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches for `step` and the target-token count of the whole global batch. Every rank
        reads the G rows of the step (to count targets); only its own become tensors."""
        ids, labels, pos = self.rows.take(self.indices(step))
        total = num_targets(labels)
        micro = []
        for a in range(self.accum):
            sel = slice((a * self.world + rank) * self.b, (a * self.world + rank + 1) * self.b)
            micro.append(MicroBatch(*(torch.from_numpy(np.ascontiguousarray(x[sel])) for x in (ids, labels, pos)),
                                    doc_lengths=doc_lengths(pos[sel])))
        return micro, total
