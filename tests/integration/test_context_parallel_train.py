"""engine.context_parallel through the trainer (forked `train` runs, the recipe path users take): the ranks of a
shard group read the same rows and split them, so 2 ranks with context parallelism train exactly what 1 rank
trains on the same micro-batch (fp32 tiny-cpu: packed rows of several documents, the chunked loss, eval); and 4
ranks as 2 replicas of a 2-rank shard group (hybrid_shard) train what 2 data-parallel ranks do."""
from __future__ import annotations

import json
from pathlib import Path

from tests.integration import forked

STEPS = ("train.max_steps=3", "train.eval_every=3", "train.demo_eval=false", "train.save_every=0",
         "train.save_final=false")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_training(got: Path, want: Path) -> None:
    a, b = _records(got), _records(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in y:
                assert abs(x[key] - y[key]) <= 1e-5 * abs(y[key]), (key, x, y)
    assert "eval_loss" in b[-1]


def test_context_parallel_ranks_train_what_one_rank_trains(tmp_path):
    one, split = tmp_path / "one", tmp_path / "split"
    assert forked.train("tiny-cpu", *STEPS, f"train.output_dir={one}", world=1).code == 0
    run = forked.train("tiny-cpu", *STEPS, f"train.output_dir={split}", "engine.context_parallel=true")
    assert run.code == 0, run.err
    _same_training(split, one)


def test_context_parallel_inside_hybrid_replicas_trains_what_data_parallel_does(tmp_path):
    dp, hybrid = tmp_path / "dp", tmp_path / "hybrid"
    assert forked.train("tiny-cpu", *STEPS, f"train.output_dir={dp}").code == 0
    run = forked.train("tiny-cpu", *STEPS, f"train.output_dir={hybrid}", "engine.strategy=hybrid_shard",
                       "engine.hybrid_shard_size=2", "engine.context_parallel=true", world=4)
    assert run.code == 0, run.err
    _same_training(hybrid, dp)
