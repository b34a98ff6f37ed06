"""`shardtune plan RECIPE --max-seq`: the longest data.seq_len at which the recipe, as configured, still fits.

The plan's peak grows with the sequence (activations, the loss's per-token tensors), never shrinks, so a binary
search over the sequence length finds the boundary: doubling from the recipe's own length (or halving when that
does not fit), then bisecting to a multiple of `GRANULE` tokens. Each probe is one analytic plan (no model run).
"""
from __future__ import annotations

from shardtune.plan.result import Plan, variant

GRANULE = 128  # tokens: the answer is a multiple of this
LIMIT = 1 << 24  # 16M tokens: the search stops here


def at_seq(plan: Plan, seq_len: int) -> Plan:
    return variant(plan, seq_len=seq_len)


def max_seq(plan: Plan) -> tuple[int, Plan | None]:
    """(the longest fitting sequence, its plan); (0, None) when not even GRANULE tokens fit."""
    lo, hi = 0, None  # lo fits (0: none yet), hi does not
    n = max(GRANULE, plan.setup.seq_len // GRANULE * GRANULE)
    while n <= LIMIT:
        if at_seq(plan, n).fits:
            lo = n
            if hi is not None:
                break
            n *= 2
        else:
            hi = n
            if lo or n == GRANULE:
                break
            n = max(GRANULE, n // 2 // GRANULE * GRANULE)
    if hi is None:
        return lo, at_seq(plan, lo)
    while hi - lo > GRANULE:
        mid = (lo + hi) // 2 // GRANULE * GRANULE
        if mid <= lo:
            break
        if at_seq(plan, mid).fits:
            lo = mid
        else:
            hi = mid
    return (lo, at_seq(plan, lo)) if lo else (0, None)


MLP_CHUNK = 4096  # tokens per MLP chunk that --fit tries when the recipe sets none


def long_context_options(setup, *, can_split: bool) -> list[tuple[bool, int, int]]:
    """--fit's long-context knobs for one candidate, as (offload_activations, mlp_chunk, context_parallel), cheapest
    first: the recipe's chunking without offloading, then (with checkpointing) offloading, then offloading and the
    chunked MLP; last, when `can_split` (the recipe and model allow engine.context_parallel) and the candidate's shard
    group has 2+ ranks, the most saving of those with the sequence split over the group (fewer rows per step per
    rank: the caller keeps the global batch)."""
    cp = setup.context_parallel
    if setup.checkpointing is False:
        options = [(False, setup.mlp_chunk, cp)]
    else:
        options = [(False, setup.mlp_chunk, cp), (True, setup.mlp_chunk, cp),
                   (True, setup.mlp_chunk or MLP_CHUNK, cp)]
    n = setup.shard_size
    if can_split and cp == 1 and n > 1 and setup.seq_len % n == 0:
        options.append((*options[-1][:2], n))
    return options
