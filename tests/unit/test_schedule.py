"""Our schedules (trainer/schedule.py) give transformers' get_scheduler multipliers at every step, and the same state."""
from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from shardtune.trainer.schedule import build_scheduler


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (20, 300), (5, 5)])
def test_same_lr_as_transformers_every_step(name: str, warmup: int, total: int) -> None:
    def lrs(make) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        sched = make(opt)
        out = [sched.get_last_lr()[0]]
        for _ in range(total + 2):
            opt.step()
            sched.step()
            out.append(sched.get_last_lr()[0])
        return out

    ours = lrs(lambda o: build_scheduler(name, o, warmup_steps=warmup, total_steps=total))
    theirs = lrs(lambda o: get_scheduler(name, o, num_warmup_steps=warmup, num_training_steps=total))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)


def test_scheduler_state_loads_across_implementations() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_scheduler("cosine", opt, num_warmup_steps=3, num_training_steps=10)
    for _ in range(6):
        opt.step()
        theirs.step()
    ours = build_scheduler("cosine", opt, warmup_steps=3, total_steps=10)
    ours.load_state_dict(theirs.state_dict())
    assert ours.last_epoch == 6 and ours.get_last_lr() == theirs.get_last_lr()
