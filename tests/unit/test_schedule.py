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


def adamw_and_schedule(lr: float, *, total: int, betas=(0.9, 0.999), weight_decay: float = 0.0, eps: float = 1e-8):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=lr, betas=betas, weight_decay=weight_decay,
                            eps=eps)
    return opt, build_scheduler("cosine", opt, warmup_steps=2, total_steps=total)


def rates(opt, sched, steps: int) -> list[float]:
    """The rate of each of the next `steps` optimizer steps (metrics.jsonl's lr), checked against the group's."""
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        assert opt.param_groups[0]["lr"] == out[-1]
        p = opt.param_groups[0]["params"][0]
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return out


def test_a_resume_runs_the_new_recipes_schedule_from_the_resumed_step() -> None:
    """A checkpoint of lr 3e-3 over 6 steps, resumed after step 3 with lr 1e-3 over 9: steps 4-9 run at the rates of
    a run started with 1e-3 over 9 (the scheduler state's base_lrs, the old peak, are not restored)."""
    from shardtune.checkpoint.manager import restore_schedule_step

    old_opt, old = adamw_and_schedule(3e-3, total=6)
    rates(old_opt, old, 3)
    fresh = rates(*adamw_and_schedule(1e-3, total=9), 9)
    opt, sched = adamw_and_schedule(1e-3, total=9)
    restore_schedule_step(sched, old.state_dict())
    assert sched.last_epoch == 3
    assert rates(opt, sched, 6) == pytest.approx(fresh[3:], rel=1e-15)
    # the same recipe resumes the same schedule (a checkpoint from transformers' scheduler too)
    theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    theirs = get_scheduler("cosine", theirs_opt, num_warmup_steps=2, num_training_steps=6)
    rates(theirs_opt, theirs, 3)
    opt, sched = adamw_and_schedule(3e-3, total=6)
    restore_schedule_step(sched, theirs.state_dict())
    assert rates(opt, sched, 3) == pytest.approx(rates(theirs_opt, theirs, 3), rel=1e-15)


def test_a_resume_keeps_the_recipes_optimizer_settings() -> None:
    """The torch backend's optimizer state dict carries its param groups: loading it restores the checkpoint's lr,
    betas, eps and weight decay. keep_settings puts the recipe's back, at the resumed step's rate."""
    from shardtune.checkpoint.manager import restore_schedule_step
    from shardtune.trainer.schedule import keep_settings, optimizer_settings

    old_opt, old = adamw_and_schedule(3e-3, total=6, weight_decay=0.01)
    rates(old_opt, old, 3)
    opt, sched = adamw_and_schedule(1e-3, total=9, betas=(0.8, 0.99), weight_decay=0.1, eps=1e-6)
    settings = optimizer_settings(opt)
    restore_schedule_step(sched, old.state_dict())
    opt.load_state_dict(old_opt.state_dict())  # what the torch backend's set_state_dict does to the groups
    assert opt.param_groups[0]["weight_decay"] == 0.01  # the checkpoint's, silently
    keep_settings(opt, settings, sched)
    group = opt.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.8, 0.99), 0.1, 1e-6)
    assert group["lr"] == sched.get_last_lr()[0] == rates(*adamw_and_schedule(1e-3, total=9), 4)[3]
    assert opt.state[group["params"][0]]["step"] == 3  # the moments and AdamW's counter are the checkpoint's
