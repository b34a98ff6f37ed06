"""bf16 numerics of the row-sharded vocabulary tables (engine/vocab.py) against an fp64 reference, on 2 gloo
ranks: a frequent token's embedding row and head row sum thousands of contributions, which the tables accumulate
in fp32 (as nn.Embedding's CUDA backward does); a bf16 accumulator would lose most of them. The CPU's bf16
`index_add_` sums in fp32 inside one call (CUDA's atomics do not), so for the embedding the accumulator's dtype is
checked too: the sum the CUDA kernel would run is an fp32 one."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.harness import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.engine.collectives import CommCounter
from shardtune.engine.flat_param import FlatParam
from shardtune.engine.vocab import VocabTable

VOCAB, HIDDEN, TOKENS, FREQUENT = 9, 16, 2048, 3  # tokens per rank, all of them the frequent one


class _IndexAddDtypes(TorchDispatchMode):
    """The dtype of every tensor that `index_add_` accumulates into."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_add_.default:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _table(master: torch.Tensor) -> VocabTable:
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = FlatParam([("weight", nn.Parameter(master.clone()), [])], requires_grad=True, num_decay=1,
                     shard_rank=rank, shard_size=world, compute_dtype=torch.bfloat16, device=torch.device("cpu"),
                     pad_multiple=world * HIDDEN)
    return VocabTable(flat, num_rows=VOCAB, hidden=HIDDEN, group=dist.group.WORLD, counter=CommCounter(),
                      device=torch.device("cpu"), padding_idx=None, reduce_dtype=torch.float32)


def _local_grad(table: VocabTable) -> torch.Tensor:
    return table.flat.segments[0][3].grad.view(-1, HIDDEN)[:table.num_local].double()


def _relative_error(got: torch.Tensor, want: torch.Tensor, table: VocabTable) -> float:
    """Relative to the whole table's largest entry (a rank may hold none of the frequent row)."""
    return float((got - want[table.lo:table.lo + table.num_local]).abs().max() / want.abs().max())


def _check(use: str) -> None:
    world = dist.get_world_size()
    master = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.1
    per_rank = [torch.rand(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1 + r)).to(torch.bfloat16)
                for r in range(world)]
    mine = per_rank[dist.get_rank()]
    ids = torch.full((TOKENS,), FREQUENT)
    table = _table(master)
    if use == "embedding":
        with _IndexAddDtypes() as seen:
            (table.embed(ids).float() * mine.float()).sum().backward()  # the rows' gradient: the sum of `mine`
        assert seen.dtypes == [torch.float32] * (table.num_local > 0), seen.dtypes
        want = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
        want[FREQUENT] = sum(x.double().sum(0) for x in per_rank)
    else:  # the head's chunked loss, one token per chunk: one contribution per chunk to each local row
        mine.requires_grad_(use == "head-hidden")
        table.cross_entropy(mine, ids, chunk_tokens=1).backward()
        w = master.to(torch.bfloat16).double()
        want = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
        for x in per_rank:
            d = torch.softmax(x.double() @ w.t(), -1) - nn.functional.one_hot(ids, VOCAB).double()
            want += d.to(torch.bfloat16).double().t() @ x.double()
        if use == "head-hidden":  # the hidden states' gradient: summed over the ranks' rows in fp32 (reduce_dtype)
            d = torch.softmax(mine.double() @ w.t(), -1) - nn.functional.one_hot(ids, VOCAB).double()
            want_h = d @ w
            assert mine.grad.dtype == torch.bfloat16
            assert float((mine.grad.double() - want_h).abs().max() / want_h.abs().max()) < 2 ** -7
    assert _relative_error(_local_grad(table), want, table) < 2 ** -7


def test_vocab_tables_accumulate_in_fp32():
    run_distributed(_check, 2, [{"use": "embedding"}, {"use": "head"}, {"use": "head-hidden"}])
