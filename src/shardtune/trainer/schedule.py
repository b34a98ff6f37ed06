"""Learning-rate schedules: linear warmup, then cosine or linear decay to 0, or constant.

The same multipliers as transformers' `get_scheduler("cosine" | "linear" | "constant")` (a LambdaLR over a
functools.partial, so checkpointed scheduler state is interchangeable with it; tests/unit/test_schedule.py compares
every step), without its import: `transformers.optimization` pulls in trainer_utils and with it peft, ~0.4 s of
every worker's start-up on 2 cores. As there, `constant` has no warmup.
"""
from __future__ import annotations

import functools
import math

import torch


def _warmup_then(step: int, *, warmup: int, total: int, decay: str) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if decay == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # half a cosine period: lr -> 0 at `total`


def _constant(step: int) -> float:
    return 1.0


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, *, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    if name == "constant":
        fn = functools.partial(_constant)
    else:
        assert name in ("cosine", "linear"), name  # the schema allows only these
        fn = functools.partial(_warmup_then, warmup=warmup_steps, total=total_steps, decay=name)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
