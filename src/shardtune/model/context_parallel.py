"""Context parallelism (`engine.context_parallel`): the ranks of a shard group split every row's sequence.

Each of the group's N ranks keeps 1/N of each row, contiguous: rank r holds tokens [r·s/N, (r+1)·s/N). Everything
that works token by token (embeddings, norms, MLPs, the experts, the head and the loss) runs on those tokens only,
so every activation of the step is 1/N of the row's. The ranks of a group read the same rows (the data is split over
the replicas only: `data_rank`), and the loss of each rank is its tokens' share of the global mean: the gradients the
engine sums over the shard group are the single-device gradients, as with data parallelism.

Attention is the one place where tokens meet. Before each attention the group all-gathers the keys and values (with
grouped-query attention they are kv_heads/heads of the hidden size: 1/8 for Llama-3-70B), and in backward their
gradients are reduce-scattered back (engine/collectives.py `gather_sequence`). Why an all-gather and not a ring (torchtitan's ring
attention): the gathered keys and values are small next to the queries, one collective replaces N-1 exchanges, and
every piece is an ordinary SDPA call whose kernel (flash on the CPU and on CUDA) needs no log-sum-exp merging.

A rank's queries [a, b) see the keys [0, b) of their own documents, causally. SDPA's causal flag aligns the diagonal
at the top left, so for each document a query piece that starts inside it is preceded by zero queries, one per key of
the document before the piece; their output rows are dropped. One causal SDPA call per document piece, exact, no
mask. Cost: attention is not balanced over the ranks (the last rank's queries see the whole row); a zigzag order of
the sequence would balance it, and is not done. Sliding-window layers are refused (model/moe_checks.py).

On a GPU, where packed rows take flash varlen attention (model/attention.py), the pieces do too: one call per layer
for every piece of every row, no padding. Each document is one varlen sequence of its queries on this rank (maybe
none) over its keys up to this rank's last token (`document_lengths`): flash aligns the causal diagonal at the bottom
right when a sequence has fewer queries than keys, which is exactly where a rank's queries of a document sit. One
SDPA call per piece per layer was ~92k launches per micro-batch at 80 layers of short documents.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class _Group:
    rank: int  # in the group
    size: int
    gather: Callable[[torch.Tensor], torch.Tensor]  # [b, h, n, d] per rank -> [b, h, N·n, d], with its backward


@dataclass
class _Rows:
    """The rows of the forward running now: this rank's tokens [start, stop), and per row its keys and queries cut
    at the document boundaries (`_pieces`, once per forward for every layer)."""
    start: int
    stop: int
    pieces: list[tuple[list[int], list[int], list[int | None]]]
    # per row, each document's (queries on this rank, keys up to `stop`): the varlen sequences (document_lengths)
    lengths: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


_GROUP: list[_Group] = []  # set by `enable` (the trainer), at most one
_ROWS: list[_Rows] = []  # set by `set_rows` before each training or eval forward


def enable(group: ProcessGroup | None, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Split sequences over `group` (the engine's shard group) from now on; None (one rank): nothing to split.
    `gather`: the engine's sequence all-gather over that group (engine/collectives.py `gather_sequence`)."""
    disable()
    if group is not None and dist.get_world_size(group) > 1:
        _GROUP.append(_Group(dist.get_rank(group), dist.get_world_size(group), gather))


def disable() -> None:
    _GROUP.clear()
    _ROWS.clear()


def size() -> int:
    return _GROUP[0].size if _GROUP else 1


def data_rank(rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world size) of the data: the ranks of one shard group read the same rows. Shard groups are runs of
    consecutive ranks (engine/shard.py `build_groups`)."""
    n = size()
    return rank // n, world_size // n


def counts_rows() -> bool:
    """Whether this rank counts the rows it shares with its group (one rank per group does)."""
    return not _GROUP or _GROUP[0].rank == 0


def bounds(seq_len: int) -> tuple[int, int]:
    """This rank's tokens [a, b) of a row of `seq_len` (a multiple of the group size: engine config checks)."""
    g = _GROUP[0]
    n = seq_len // g.size
    assert n * g.size == seq_len, "seq_len is a multiple of the context-parallel group"
    return g.rank * n, (g.rank + 1) * n


def set_rows(start: int, stop: int, docs: Sequence[Sequence[int]]) -> None:
    """The rows of the forward about to run. They stay set after it: activation checkpointing recomputes the units
    in backward, whose attention must split the same rows; the next training or eval forward replaces them."""
    pieces = [_pieces(row, start, stop) for row in docs]
    queries = tuple(tuple(0 if f is None else q[f] for f in firsts) for q, _, firsts in pieces)
    _ROWS[:] = [_Rows(start, stop, pieces, (queries, tuple(tuple(k) for _, k, _ in pieces)))]


def active() -> bool:
    """Rows are split over a group (the attention gathers keys and values)."""
    return bool(_ROWS) and bool(_GROUP)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sdpa: Any) -> torch.Tensor:
    """This rank's queries [b, heads, n, d] over the group's keys and values -> [b, heads, n, d].
    `sdpa(q, k, v)`: one causal call (model/attention.py's, with its scale, dropout and grouped heads)."""
    r = _ROWS[-1]
    assert query.shape[2] == r.stop - r.start, "a forward over this rank's part of the rows"
    keys, values = gather(key, value)
    out = []
    for (q_cuts, k_cuts, firsts), q_row, k_row, v_row in zip(r.pieces, query.split(1), keys.split(1),
                                                             values.split(1), strict=True):
        parts = []
        qs = q_row.split(q_cuts, dim=2)
        for k, v, first in zip(k_row.split(k_cuts, dim=2), v_row.split(k_cuts, dim=2), firsts, strict=True):
            if first is None:  # a document that ends before this rank's tokens: no query of it here
                continue
            q = qs[first]
            pad = k.shape[2] - q.shape[2]  # the document's keys before this rank's first query of it
            if pad:
                q = torch.cat([q.new_zeros(*q.shape[:2], pad, q.shape[3]), q], dim=2)
            parts.append(sdpa(q, k, v)[:, :, pad:])
        out.append(torch.cat(parts, dim=2))
    return torch.cat(out, dim=0)


def gather(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's keys and values [b, kv_heads, n, d] -> the group's, up to this rank's last token [b, kv_heads, z, d]."""
    g, r = _GROUP[0], _ROWS[-1]
    assert key.shape[2] == r.stop - r.start, "a forward over this rank's part of the rows"
    return g.gather(key)[:, :, :r.stop], g.gather(value)[:, :, :r.stop]


def document_lengths() -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per row, each document that starts before this rank's last token: (its queries on this rank, 0 for one that
    ended before them; its keys up to that token). What flash varlen takes, causal at the bottom right."""
    return _ROWS[-1].lengths


def _pieces(docs: Sequence[int], a: int, z: int) -> tuple[list[int], list[int], list[int | None]]:
    """Cut a row's keys [0, z) and this rank's queries [a, z) at the document boundaries: (query piece lengths,
    key piece lengths, per key piece the index of its query piece or None when it has none). Query pieces of
    length 0 are not listed; every key piece with queries is the whole document up to z."""
    q_cuts, k_cuts, firsts = [], [], []
    start = 0
    for n in docs:
        end = start + n
        if start >= z:
            break
        k_cuts.append(min(end, z) - start)
        lo, hi = max(start, a), min(end, z)
        if hi > lo:
            firsts.append(len(q_cuts))
            q_cuts.append(hi - lo)
        else:
            firsts.append(None)
        start = end
    return q_cuts, k_cuts, firsts
