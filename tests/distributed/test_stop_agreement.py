"""A stop signal that reaches one rank stops every rank after the same step (trainer/signals.py): the ranks' votes
ride on the step's own all-reduce and host read (train.train_step), with no collective of their own. 2 gloo ranks,
the real trainer on tiny-cpu."""
from __future__ import annotations

import os
import signal

import torch.distributed as dist
from tests.distributed.harness import run_distributed

from shardtune.config.load import load_recipe
from shardtune.trainer.signals import StopRequest
from shardtune.trainer.train import setup, train_step


def _agree(tmp: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what torchrun would set
    run = setup(load_recipe("tiny-cpu", ["data.num_samples=64", "data.seq_len=32", f"data.cache_dir={tmp}/cache",
                                         f"train.output_dir={tmp}/run", "train.demo_eval=false"]))
    stop = StopRequest()  # a forked rank's own handlers
    reduces = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: reduces.append(1) or all_reduce(*a, **k)
    try:
        train_step(run, 0, None)  # no agreement asked: the collectives of a step
        plain = len(reduces)
        for step, asking in enumerate([None, 1, 0], start=1):  # nobody, then rank 1 alone, then rank 0 alone
            reduces.clear()
            stop.signum = signal.SIGTERM if asking == rank else None
            train_step(run, step, None, stop)
            assert stop.stopping == (asking is not None), (rank, step, asking)
            assert len(reduces) == plain, (len(reduces), plain)  # the agreement added no collective
    finally:
        dist.all_reduce = all_reduce


def test_one_ranks_signal_stops_every_rank_after_the_same_step(tmp_path) -> None:
    run_distributed(_agree, 2, [dict(tmp=str(tmp_path))])
