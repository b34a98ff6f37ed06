"""GRPO's sampling on the sharded model at 2 ranks, each rank half the prompts: the completions one unsharded process
draws, bit for bit where each rank's share is whole batches; ranks with different numbers of batches and stops stay
in lockstep (every forward gathers parameters)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.common import build_model, computed_by_one_rank, policy_for
from tests.distributed.harness import run_distributed

from shardtune.engine.shard import shard_model
from shardtune.trainer.sampling import sample_completions

PROMPTS = [[5, 9, 17, 3], [44, 6, 90, 91, 7, 8, 12], [100], [33, 34, 35, 36, 37], [8, 8, 9], [70, 71]]
KEYS = [(11, 2, 40 + i) for i in range(len(PROMPTS))]
KW = {"num_generations": 2, "max_new_tokens": 10, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "pad_id": 0,
      "device": "cpu"}


def _draw(model, prompts, keys, **kw):
    return sample_completions(model, prompts, keys=keys, logprobs=True, **{**KW, **kw})


def _ranks(prompts_per_batch: int | None, uneven: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank 0: 4 prompts, rank 1: 2 (uneven: a different number of batches), or 3 each
    cut = 4 if uneven else 3
    mine = slice(0, cut) if rank == 0 else slice(cut, None)

    def reference():
        ref = build_model("tiny-llama").eval()
        free = _draw(ref, PROMPTS, KEYS, stop_ids=[], prompts_per_batch=prompts_per_batch)
        stop = free[0][5][3]  # a token one row draws: it ends some rows early, on one rank
        return stop, free, _draw(ref, PROMPTS, KEYS, stop_ids=[stop, 2], prompts_per_batch=prompts_per_batch)

    stop, free, stopped = computed_by_one_rank(f"sampling{prompts_per_batch}{uneven}", reference)
    # rows stop at different steps
    assert any(len(c) < 10 for c in stopped[0]) and any(len(c) == 10 for c in stopped[0])
    model = build_model("tiny-llama").eval()
    shard_model(model, policy_for(model, "full_shard", world=world), device=torch.device("cpu"))
    rows = slice(mine.start * 2, None if mine.stop is None else mine.stop * 2)
    for want, stop_ids in ((free, []), (stopped, [stop, 2])):
        # every rank all the prompts, on the same sharded model: the same engine, no split
        whole = _draw(model, PROMPTS, KEYS, stop_ids=stop_ids, world_size=world, prompts_per_batch=prompts_per_batch)
        got, logprobs = _draw(model, PROMPTS[mine], KEYS[mine], stop_ids=stop_ids, world_size=world,
                              prompts_per_batch=prompts_per_batch)
        assert got == want[0][rows] == whole[0][rows], (rank, got, want[0][rows])
        if prompts_per_batch == 1:  # the same batches as the whole's: the same bits
            assert logprobs == whole[1][rows]
        # the unsharded model's: the gathered weights' GEMMs may round otherwise (last bit)
        assert max(abs(a - b) for x, y in zip(logprobs, want[1][rows]) for a, b in zip(x, y)) < 1e-5

def test_sampling_2_ranks_draws_what_1_rank_draws() -> None:
    run_distributed(_ranks, 2, [{"prompts_per_batch": 1, "uneven": True}, {"prompts_per_batch": None, "uneven": False},
                                {"prompts_per_batch": 1, "uneven": False}])
