"""An offloaded vocabulary table's gradient on the simulated GPU (test_offload_table_grads.py): the rows' gradient
of each use leaves the device without blocking the host, on the copy stream, into the table's pinned buffers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.engine.shard import shard_model
from tests.distributed.common import build_model, policy_for, token_loss_sum

SIM = accelerator.SIMULATED


def table_gradients_copied_without_blocking() -> None:
    """cpu_offload, full fine-tuning, row-sharded untied tables (the product's defaults), two micro-steps: each use
    (embedding, head) issues one D2H of its rows' gradient on the copy stream ("h2d"), after waiting for an event
    of the compute stream (where the gradient was written); the host waits for nothing and reads nothing during
    the backward; it waits on exactly the copies' events when the gradients are read (clipping), and the gradient
    it then finds is one of the table's own pinned landing buffers (two per table at most)."""
    model = build_model("tiny-llama")
    policy = policy_for(model, "full_shard", world=dist.get_world_size(), cpu_offload=True)
    assert policy.vocab_parallel and policy.cpu_offload
    sharded = shard_model(model, policy, device=SIM)
    tables = [f for f in sharded.ctx.root.flats if f.local]
    assert len(tables) == 2  # tiny-llama's embedding and head are untied
    for micro in range(2):
        ids = torch.randint(3, 128, (1, 16), device=SIM)
        loss = token_loss_sum(sharded.module, ids, ids)  # (its root pre-forward adds the earlier copies: host waits)
        accelerator.TRACE.clear()
        loss.backward()
        trace = list(accelerator.TRACE.entries)
        copies = [i for i, e in enumerate(trace) if e[:3] == ("op", "h2d", "d2h")]
        assert len(copies) == 2, [e for e in trace if e[0] == "op" and e[2] == "d2h"]
        recorded = {e[2]: (e[1], i) for i, e in enumerate(trace) if e[0] == "record"}
        for i in copies:
            waits = [e for e in trace[:i] if e[:2] == ("wait_event", "h2d") and recorded[e[2]][0] == "compute"]
            assert waits, "the copy stream did not wait for the gradient's event"
            after = trace[i + 1]
            assert after[:2] == ("record", "h2d"), after  # the copy's own event
        blocked = [e for e in trace if e[0] in ("host_wait", "host_sync")]
        assert not blocked, f"the host blocked during the backward: {blocked}"
        if micro == 0:
            continue  # the next forward adds this micro-step's copies on the host (their events waited)
        done = {trace[i + 1][2] for i in copies}
        accelerator.TRACE.clear()
        sharded.wait_reductions()
        waited = {e[2] for e in accelerator.TRACE.entries if e[0] == "host_wait"}
        assert done <= waited, (done, waited)
    for flat in tables:
        (_, _, _, segment), = flat.segments
        buffers = sharded.ctx.reducer._landing_buffers[flat]
        assert len(buffers) == 2  # the gradient, and the second micro-step's copy added into it
        assert any(segment.grad is b for b in buffers) and all(b.is_pinned() for b in buffers)


def hybrid_table_gradients_reduced_without_blocking() -> None:
    """hybrid_shard (shard groups of 2) + cpu_offload, full fine-tuning, two micro-steps, the replicas' sum on the
    last: each use's copy lands on the host and is summed into the replicas' pinned bucket; the bucket goes H2D
    without a host sync ("h2d" from pinned memory), is all-reduced over the replicas on the device, and each
    table's slice comes back D2H on the copy stream. The host never synchronizes during the backward (it waits on
    the uses' copy events only, to sum them), and the gradient it finds at clipping is a pinned landing buffer."""
    model = build_model("tiny-llama")
    policy = policy_for(model, "hybrid_shard", world=dist.get_world_size(), cpu_offload=True)
    assert policy.vocab_parallel and policy.cpu_offload
    sharded = shard_model(model, policy, device=SIM)
    tables = [f for f in sharded.ctx.root.flats if f.local]
    assert len(tables) == 2 and sharded.ctx.vocab_replicas is not None
    for micro in range(2):
        sharded.set_requires_all_reduce(micro == 1)
        ids = torch.randint(3, 128, (1, 16), device=SIM)
        loss = token_loss_sum(sharded.module, ids, ids)
        accelerator.TRACE.clear()
        loss.backward()
        trace = list(accelerator.TRACE.entries)
        synced = [e for e in trace if e[0] == "host_sync"]
        assert not synced, f"the host synchronized during the backward: {synced}"
        if micro == 0:
            continue
        ops = [(i, e) for i, e in enumerate(trace) if e[0] == "op"]
        h2d = [i for i, e in ops if e[2] == "h2d" and e[3] == "vocab"]
        reduce = [i for i, e in ops if e[2] == "all_reduce" and e[3] == "vocab"]
        back = [i for i, e in ops if e[1:3] == ("h2d", "d2h") and reduce and i > reduce[0]]
        assert len(h2d) == 1 and len(reduce) == 1 and h2d[0] < reduce[0], [e for _, e in ops]
        assert len(back) == 2, [e for _, e in ops]  # one D2H per table, on the copy stream, after the all-reduce
        accelerator.TRACE.clear()
        sharded.wait_reductions()
        assert not [e for e in accelerator.TRACE.entries if e[0] == "host_sync"]
    bucket = sharded.ctx.vocab_replicas._host_bucket
    assert bucket is not None and bucket.is_pinned()
    for flat in tables:
        (_, _, _, segment), = flat.segments
        buffers = sharded.ctx.reducer._landing_buffers[flat]
        assert any(segment.grad is b for b in buffers) and all(b.is_pinned() for b in buffers)


def run_checks(names: list[str]) -> None:
    for name in names:
        torch.manual_seed(0)
        globals()[name]()
        dist.barrier(group=accelerator.host_group())
