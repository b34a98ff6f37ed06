"""Host bytes of an offloaded row-sharded vocabulary table's gradient (engine/vocab.py, engine/reduce.py)."""
from __future__ import annotations

from shardtune.engine.layout import FlatLayout


def table_grad_host_bytes(table: FlatLayout, *, replicated: bool, grad_accum: int) -> int:
    """Each use's gradient of the local rows (fp32, P/W) goes D2H into one of the table's pinned buffers, made once
    at their exact size and reused every step. The first copy of a step becomes the host gradient; a later one
    (the next micro-step's, or the other use of a tied table) lands in a second buffer until it is added. Hybrid:
    each copy is summed into the replicas' fp32 bucket once it lands (one buffer is enough), and the summed bucket
    comes back as a gradient of its own, replacing the bucket (engine/replicated.py). `replicated`: the table has
    replicas (hybrid: world > shard group); `grad_accum`: micro-steps per step."""
    if not table.requires_grad:
        return 0
    copy = 4 * table.shard_numel
    if replicated:
        return 2 * copy  # the landing buffer, and the bucket or (from the end of backward) the reduced gradient
    return copy * (2 if grad_accum > 1 or table.uses > 1 else 1)
