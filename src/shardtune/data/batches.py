"""World-size-independent global batches.

Step k uses rows [k*G, (k+1)*G) of a seeded permutation (a fresh permutation per epoch), G = micro_batch_size *
world_size * grad_accum. Inside the step, rank r at micro-step a takes the b rows at offset (a*W + r)*b. So W
workers x A micro-steps and W' x A' with W*A = W'*A' train on exactly the same rows per optimizer step, and the
loss of each micro-batch is divided by the target-token count of the whole global batch (every rank can count
it locally: all ranks index the same rows), which makes the summed gradient equal to single-device training.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.data.formats import IGNORE
from shardtune.data.packing import Rows


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, seq_len]
    labels: torch.Tensor  # [b, seq_len]
    position_ids: torch.Tensor  # [b, seq_len]

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(self.input_ids.to(device), self.labels.to(device), self.position_ids.to(device))


def num_targets(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the causal shift (position t predicts label t+1)."""
    return int((labels[:, 1:] != IGNORE).sum())


class GlobalBatches:
    def __init__(self, rows: Rows, *, micro_batch_size: int, grad_accum: int, world_size: int, seed: int) -> None:
        self.rows = rows
        self.b = micro_batch_size
        self.accum = grad_accum
        self.world = world_size
        self.seed = seed
        self.global_size = micro_batch_size * grad_accum * world_size
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.rows), generator=g)}  # keep one epoch in memory
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        """The G row indices of optimizer step `step` (0-based); wraps into the next epoch as needed."""
        n = len(self.rows)
        out = []
        for pos in range(step * self.global_size, (step + 1) * self.global_size):
            out.append(self._perm(pos // n)[pos % n])
        return torch.stack(out)

    def step(self, step: int, rank: int) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches for `step` and the target-token count of the whole global batch."""
        idx = self.indices(step)
        total = num_targets(self.rows.labels[idx])
        micro = []
        for a in range(self.accum):
            start = (a * self.world + rank) * self.b
            sel = idx[start : start + self.b]
            micro.append(MicroBatch(self.rows.input_ids[sel], self.rows.labels[sel], self.rows.position_ids[sel]))
        return micro, total
