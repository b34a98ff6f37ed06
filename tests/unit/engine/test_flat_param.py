"""FlatParam layout without processes: padding, shard slices, decay/no-decay segments, views, free/realloc."""
from __future__ import annotations

import torch
from torch import nn

from shardtune.engine.flat_param import FlatParam


def _params() -> tuple[nn.Module, list]:
    m = nn.Module()
    m.w = nn.Parameter(torch.arange(6.0).view(2, 3))  # decay
    m.v = nn.Parameter(torch.arange(6.0, 10.0).view(2, 2))  # decay
    m.b = nn.Parameter(torch.arange(10.0, 13.0))  # no decay
    return m, [("w", m.w, [(m, "w")]), ("v", m.v, [(m, "v")]), ("b", m.b, [(m, "b")])]


def test_shards_segments_and_padding() -> None:
    _, params = _params()
    flats = [FlatParam(params, requires_grad=True, num_decay=2, shard_rank=r, shard_size=2,
                       compute_dtype=torch.float32, device=torch.device("cpu")) for r in range(2)]
    f0, f1 = flats
    assert (f0.numel, f0.padded_numel, f0.shard_numel) == (13, 14, 7)
    assert torch.equal(torch.cat([f0.shard, f1.shard]), torch.cat([torch.arange(13.0), torch.zeros(1)]))
    # rank 0 owns 7 decay elements; rank 1 owns 3 decay, 3 no-decay and 1 padding element
    assert [(d, a, b) for d, a, b, _ in f0.segments] == [(True, 0, 7)]
    assert [(d, a, b) for d, a, b, _ in f1.segments] == [(True, 0, 3), (False, 3, 6)]
    seg = f1.segments[1][3]
    assert isinstance(seg, nn.Parameter) and seg.data_ptr() == f1.shard[3:].data_ptr()  # shares storage
    f1.accumulate_shard_grad(torch.ones(7))
    f1.accumulate_shard_grad(torch.ones(7))
    assert torch.equal(seg.grad, torch.full((3,), 2.0)) and seg.grad.data_ptr() == f1.shard_grad()[3:].data_ptr()
    for _, _, _, s in f1.segments:  # what optimizer.zero_grad(set_to_none=True) does
        s.grad = None
    assert f1.shard_grad() is None and f1.state_bytes() == 7 * 4


def test_views_alias_the_gathered_buffer_and_survive_free() -> None:
    m, params = _params()
    flat = FlatParam(params, requires_grad=True, num_decay=2, shard_rank=0, shard_size=2,
                     compute_dtype=torch.float32, device=torch.device("cpu"))
    assert not flat.is_full_allocated()
    flat.alloc_full()
    flat.full.copy_(torch.arange(14.0))
    leaf, views = flat.bind_views(requires_grad=True)
    assert len(views) == 3 and views[0] is m.w
    assert torch.equal(m.b.detach(), torch.tensor([10.0, 11.0, 12.0]))
    (m.w.sum() * 2 + m.b.sum()).backward()
    assert leaf.grad.shape == (14,) and torch.equal(leaf.grad, torch.tensor([2.0] * 6 + [0.0] * 4 + [1.0] * 3 + [0.0]))
    saved = m.w
    flat.free_full()
    assert flat.full.untyped_storage().nbytes() == 0
    flat.alloc_full()
    flat.full.fill_(5.0)
    assert torch.equal(saved.detach(), torch.full((2, 3), 5.0))  # an old view sees the refilled storage


def test_no_shard_fp32_aliases_the_shard() -> None:
    _, params = _params()
    flat = FlatParam(params, requires_grad=True, num_decay=2, shard_rank=0, shard_size=1,
                     compute_dtype=torch.float32, device=torch.device("cpu"))
    assert flat.aliased and flat.full is flat.shard and flat.padded_numel == 13
    flat.free_full()
    assert flat.is_full_allocated()  # never freed: it is the master copy
