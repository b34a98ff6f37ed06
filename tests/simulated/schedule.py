"""The engine's stream schedule on the simulated GPU: one forward, backward and clip of a tiny model, then the
recorded order (accelerator.TRACE) is checked against what the GPU needs (test_schedule.py)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.engine.api import BackwardSchedule
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.shard import shard_model
from tests.distributed.common import build_model, policy_for, token_loss_sum

SIM = accelerator.SIMULATED


def _step(strategy: str, **policy_changes) -> list[tuple]:
    model = build_model("tiny-llama")
    policy = dataclasses.replace(policy_for(model, strategy, world=dist.get_world_size()), **policy_changes)
    sharded = shard_model(model, policy, device=SIM)
    ids = torch.randint(3, 128, (1, 16), device=SIM)
    accelerator.TRACE.clear()
    token_loss_sum(sharded.module, ids, ids).backward()
    sharded.clip_grad_norm_(1.0)
    return list(accelerator.TRACE.entries)


def _index(trace: list[tuple], pred) -> list[int]:
    return [i for i, e in enumerate(trace) if pred(e)]


def offload_copies_on_copy_stream() -> None:
    """Finding 4: offload's H2D copies, their casts and the all-gathers that read them go on the copy stream; the
    compute stream waits on each gather's event, never on the whole copy stream. The units' copies, with the
    tables in the root (engine.vocab_parallel=false): row-sharded tables are copied by vocab.py at their use, on the
    compute stream, and their token all-gathers run there too."""
    trace = _step("full_shard", cpu_offload=True, vocab_parallel=False, mixed_precision=dataclasses.replace(
        policy_for(build_model("tiny-llama"), "full_shard", world=2).mixed_precision, param_dtype=torch.bfloat16))
    copies = [e for e in trace if e[0] == "op" and e[2] in ("h2d", "cast")]
    gathers = [e for e in trace if e[0] == "op" and e[2] == "all_gather"]
    assert copies and gathers
    assert {e[1] for e in copies} == {"h2d"} and {e[1] for e in gathers} == {"h2d"}, (copies, gathers)
    assert not [e for e in trace if e[0] == "wait_stream" and e[1] == "compute"], "compute waited on a stream"
    recorded = {e[2]: i for i, e in enumerate(trace) if e[0] == "record" and e[1] == "h2d"}
    reduced = {e[2] for e in trace if e[0] == "record" and e[1] == "reduce"}  # offload's D2H copies of gradients
    waits = _index(trace, lambda e: e[0] == "wait_event" and e[1] == "compute" and e[2] not in reduced)
    assert waits and all(trace[i][2] in recorded and recorded[trace[i][2]] < i for i in waits)
    # Every gather's copies come before the event the compute waits on: the event covers them.
    for label in {e[3] for e in gathers}:
        last_copy = max(_index(trace, lambda e, lb=label: e[0] == "op" and e[2] == "h2d" and e[3] == lb))
        assert any(recorded[trace[i][2]] > last_copy for i in waits)
    # The copy stream first waits for the compute queued before it (the memory it writes was compute's).
    assert _index(trace, lambda e: e == ("wait_stream", "h2d", "compute"))


def offload_tables_copied_ahead() -> None:
    """Offload with vocabulary-parallel tables: each table's rows are copied once per unshard of the root, on the
    copy stream with the root's gather (covered by the event the compute stream waits on), not on the compute
    stream at every use (embedding, head, backward)."""
    trace = _step("full_shard", cpu_offload=True, vocab_parallel=True)
    copies = [e for e in trace if e[0] == "op" and e[2] == "h2d"]
    assert copies and {e[1] for e in copies} == {"h2d"}, copies
    roots = [e for e in copies if e[3] == "root"]
    assert len(roots) == 3, roots  # the root's own flat (final norm) and the two tables (untied Llama), once each


def hybrid_all_reduce_on_its_stream() -> None:
    """Finding 6: each replica all-reduce is issued right after its reduce-scatter, on its own stream (which waits
    for that reduce-scatter); the compute stream waits for it before the next unit's reduce-scatter goes out (at
    most one reduction in flight, as FSDP2), and for all of them before clipping's norm all-reduce."""
    trace = _step("hybrid_shard", hybrid_shard_size=2)
    # The units' gradients (the row-sharded tables' reduce-scatter activations, and their gradient is summed over
    # the replicas at the end of backward: label "vocab")
    rs = _index(trace, lambda e: e[0] == "op" and e[2] == "reduce_scatter" and e[3] != "vocab")
    ar = _index(trace, lambda e: e[0] == "op" and e[2] == "all_reduce" and e[3] not in ("", "vocab"))
    assert rs and len(ar) == len(rs)
    for i in rs:
        label = trace[i][3]
        (j,) = [k for k in ar if trace[k][3] == label]
        assert trace[j][1] == "replica" and j > i
        between = trace[i + 1:j]
        assert ("wait_work", "replica", f"reduce_scatter:{label}") in between
        assert not [e for e in between if e[0] == "op" and e[2] == "reduce_scatter"], "issued late"
    _each_reduction_waited_before_the_next(trace, lambda label: ("wait_work", "compute", f"all_reduce:{label}"))


def _each_reduction_waited_before_the_next(trace: list[tuple], wait_entry) -> None:
    """Every reduction's completion (`wait_entry(label)`, a compute-stream wait) comes before the next unit's
    reduce-scatter is issued, and every one before clipping's norm all-reduce."""
    rs = _index(trace, lambda e: e[0] == "op" and e[2] == "reduce_scatter" and e[3] != "vocab")  # units' only
    norm = _index(trace, lambda e: e[0] == "op" and e[2] == "all_reduce" and not e[3])
    assert len(rs) >= 4 and norm
    for i, j in zip(rs, [*rs[1:], min(norm)], strict=True):
        assert wait_entry(trace[i][3]) in trace[i + 1:j], f"reduction of {trace[i][3]} still in flight"


def offload_reductions_bounded() -> None:
    """Offload: each reduction's D2H copy runs on the reduce stream, and the compute stream waits for its event
    before the next unit's reduce-scatter goes out: no gradient outlives its copy by more than one unit."""
    trace = _step("full_shard", cpu_offload=True)
    copied = {}  # label -> the event recorded on the reduce stream after its D2H copy
    for i, e in enumerate(trace):
        if e[0] == "op" and e[2] == "d2h":
            if e[1] == "h2d" and e[3] == "root":
                continue  # the row-sharded tables' gradients, copied on the copy stream (offload_table_grads.py)
            assert e[1] == "reduce"
            copied[e[3]] = next(f[2] for f in trace[i + 1:] if f[0] == "record" and f[1] == "reduce")
    _each_reduction_waited_before_the_next(trace, lambda label: ("wait_event", "compute", copied[label]))


def _backward_order(schedule: BackwardSchedule) -> list[tuple[int, int, int]]:
    """Per pair of consecutive units j, j-1 in backward: (index of the wait for unit j's reduce-scatter, index of
    the backward gather of unit j-2, index of unit j-1's reduce-scatter)."""
    trace = _step("full_shard", backward_schedule=schedule)
    rs = {e[3]: i for i, e in enumerate(trace) if e[0] == "op" and e[2] == "reduce_scatter"}
    gathers: dict[str, int] = {}
    for i, e in enumerate(trace):
        if e[0] == "op" and e[2] == "all_gather":
            gathers[e[3]] = i  # the last one: the backward's gather (the forward's came first)
    waits = {e[2].split(":", 1)[1]: i for i, e in enumerate(trace)
             if e[0] == "wait_work" and e[1] == "compute" and e[2].startswith("reduce_scatter:")}
    units = sorted(int(k[4:]) for k in rs if k.startswith("unit"))
    assert len(units) >= 4 and all(f"unit{j}" in waits for j in units)
    return [(waits[f"unit{j}"], gathers[f"unit{j - 2}"], rs[f"unit{j - 1}"]) for j in units if j >= 2]


def backward_overlaps_like_fsdp2() -> None:
    """Finding 5, overlap (the default on a GPU): unit j-1's pre-backward gathers unit j-2 at once, and unit j's
    reduce-scatter is waited for only at unit j-1's post-backward (just before its own reduce-scatter goes out)."""
    for wait, gather, next_rs in _backward_order(BackwardSchedule.OVERLAP):
        assert gather < wait < next_rs, (gather, wait, next_rs)
    # The staggered schedule (CPU's default) retires the reduction first and gathers after: the check tells them
    # apart.
    for wait, gather, next_rs in _backward_order(BackwardSchedule.STAGGERED):
        assert wait < gather < next_rs, (wait, gather, next_rs)


def activation_offload_on_copy_stream() -> None:
    """engine.offload_activations: each checkpointed unit's input goes D2H on the offload stream in forward and comes
    back H2D on it ahead of its recompute; the compute stream waits on each fetch's event (recorded before the wait),
    never on a whole stream, and the host never waits."""
    model = build_model("tiny-llama")
    policy = policy_for(model, "full_shard", world=dist.get_world_size())
    offloader = ActivationOffloader(SIM)
    units = len(apply_activation_checkpointing(model, policy.unit_classes, offloader=offloader))
    sharded = shard_model(model, policy, device=SIM)
    ids = torch.randint(3, 128, (1, 16), device=SIM)
    accelerator.TRACE.clear()
    token_loss_sum(sharded.module, ids, ids).backward()
    trace = list(accelerator.TRACE.entries)
    d2h = _index(trace, lambda e: e[0] == "op" and e[2] == "d2h" and e[3] == "activation")
    h2d = _index(trace, lambda e: e[0] == "op" and e[2] == "h2d" and e[3] == "activation")
    assert len(d2h) == len(h2d) == units and max(d2h) < min(h2d), (d2h, h2d)
    assert {trace[i][1] for i in d2h + h2d} == {"activation-offload"}
    fetched = {trace[i + 1][2]: i + 1 for i in h2d}  # the event recorded right after each H2D copy
    assert all(trace[i][0] == "record" and trace[i][1] == "activation-offload" for i in fetched.values())
    waits = {e[2]: i for i, e in enumerate(trace) if e[0] == "wait_event" and e[1] == "compute" and e[2] in fetched}
    assert len(waits) == units and all(fetched[ev] < i for ev, i in waits.items())
    assert offloader.num_fetched_ahead == units - 1  # every unit but the last-run one was fetched ahead
    assert not [e for e in trace if e[0] == "wait_stream" and e[1] == "compute"], "compute waited on a stream"
    assert not [e for e in trace if e[0] == "host_wait"], "the host waited"


def run_checks(names: list[str]) -> None:
    for name in names:
        torch.manual_seed(0)
        globals()[name]()
        dist.barrier(group=accelerator.host_group())
