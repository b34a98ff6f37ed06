"""Host synchronizations of a training step, counted on the simulated GPU (accelerator.host_syncs): a host read
(.item(), bool(), .tolist(), to_host), a host<->device copy CUDA runs synchronously (pageable memory, or no
non_blocking), a full device sync. A step has one: its read of the loss and the norm, after which the optimizer
and the next step's work are queued without waiting; the next step's batch is already on its way (prefetched
before the read). transformers' packed-sequence check (a `.all()` per forward on position_ids) is not run: the
per-document attention registers no mask function (model/attention_mask.py)."""
from __future__ import annotations

import tempfile

import pytest

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.plan.simulate import _simulated_world

STEP_READ = ("to_host", "shardtune.trainer.train:train_step")


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny-cpu", []),  # full fine-tuning, vocab-parallel tables
    ("tiny-cpu", ["engine.cpu_offload=true"]),
    ("tiny-lora-cpu", ["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=1", "engine.cpu_offload=true"]),
    ("tiny-dpo-cpu", ["dpo.precompute_reference=true"]),  # the reference log-probs copied per micro-step
])
def test_one_host_sync_per_step(recipe: str, overrides: list[str]) -> None:
    from shardtune.trainer.train import setup, train_step

    with tempfile.TemporaryDirectory() as tmp, _simulated_world(2, 1):
        recipe = load_recipe(recipe, ["launch.device=cuda", "train.grad_accum=3", "train.micro_batch_size=2",
                                      "data.num_samples=200", f"train.output_dir={tmp}", *overrides])
        run = setup(recipe, simulated=True)
        run.model.train()
        for step in range(2):  # the first step copies its own batch; the second finds it prefetched
            accelerator.TRACE.clear()
            record = train_step(run, step, None)
            assert accelerator.host_syncs() == [STEP_READ]
            assert run.prefetched is not None and run.prefetched[0] == step + 1  # the next batch is on its way
            assert record["loss"] == 0.0 and record["step_time_s"] > 0  # meta: values read as zeros
