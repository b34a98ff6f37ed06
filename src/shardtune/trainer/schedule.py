"""Learning-rate schedules: linear warmup, then cosine or linear decay to 0, or constant.

The same multipliers as transformers' `get_scheduler("cosine" | "linear" | "constant")` (a LambdaLR over a
functools.partial, so checkpointed scheduler state is interchangeable with it; tests/unit/test_schedule.py compares
every step), without its import: `transformers.optimization` pulls in trainer_utils and with it peft, ~0.4 s of
every worker's start-up on 2 cores. As there, `constant` has no warmup.
"""
from __future__ import annotations

import functools
import math
from typing import Any

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


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters: lr, betas, eps, weight_decay, the kernel flags."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def keep_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]],
                  scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """After a resume: the recipe's settings (`optimizer_settings` before the load) at the scheduler's rate for the
    resumed step. The torch backend's optimizer state dict carries its param groups, and loading it restored the
    checkpoint's lr, betas, eps and weight decay: a changed value in the recipe was silently ignored."""
    for group, own, lr in zip(optimizer.param_groups, settings, scheduler.get_last_lr(), strict=True):
        group.update(own, lr=lr)
