"""Finding 8 (issue 20): one host read per optimizer step (the loss is summed on the device, not read per
micro-step), and the step time is taken after a device sync. Counted on the simulated GPU, where every host read
goes through the seam (accelerator.to_host / item) and a device sync is recorded in accelerator.TRACE."""
from __future__ import annotations

import tempfile

import pytest

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.plan.simulate import _simulated_world


def test_one_host_read_and_one_sync_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardtune.train import setup, train_step

    reads: list[str] = []
    to_host = accelerator.to_host
    monkeypatch.setattr(accelerator, "to_host", lambda t: reads.append("to_host") or to_host(t))
    monkeypatch.setattr(accelerator, "item", lambda t: reads.append("item") or to_host(t).item())
    with tempfile.TemporaryDirectory() as tmp, _simulated_world(2, 1):
        recipe = load_recipe("recipes/tiny-cpu.yaml", ["train.grad_accum=4", "train.micro_batch_size=2",
                                                       "data.num_samples=200", f"train.output_dir={tmp}"])
        run = setup(recipe, simulated=True)
        run.model.train()
        for step in range(1):
            reads.clear()
            accelerator.TRACE.clear()
            record = train_step(run, step, None)
            assert reads == ["to_host"], reads  # 4 micro-steps, one read
            syncs = [e for e in accelerator.TRACE.entries if e[0] == "host_wait"]
            assert syncs == [("host_wait", "host", "all")]
            assert accelerator.TRACE.entries[-1] == syncs[0]  # after the optimizer's work, before the clock stops
            assert record["loss"] == 0.0 and record["step_time_s"] > 0  # meta: values read as zeros
