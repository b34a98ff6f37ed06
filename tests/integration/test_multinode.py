"""Two "nodes" on one machine: two torchrun launches meeting at a c10d rendezvous on 127.0.0.1.

`launch.nnodes=2 launch.rdzv_endpoint=127.0.0.1:PORT launch.nproc_per_node=1 launch.node_rank=0|1` must train to
the same fp32 losses as one node with 2 workers: the world (2 ranks), the global batch and the sharding are the
same; only the launcher topology differs.
"""
from __future__ import annotations

from shardtune.trainer.runtime import free_port
from tests.integration.multinode_common import (
    MAX_STEPS,
    assert_same_losses,
    losses,
    reference_losses,
    run_train,
)


def test_two_nodes_match_one_node(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    tmp = tmp_path_factory.mktemp("multinode")
    run = tmp / "run"  # one run directory, as on a shared filesystem; rank 0 writes metrics.jsonl
    endpoint = f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"
    nodes = [run_train(run, "launch.nnodes=2", endpoint, "launch.nproc_per_node=1", f"launch.node_rank={r}",
                       cwd=tmp) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=900)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(nodes, outs)):
        assert p.returncode == 0, f"node {r}:\n{out[-3000:]}"
    got = losses(run)
    assert len(got) == MAX_STEPS
    assert_same_losses(got, reference_losses(base))

