"""Host synchronizations of a training step, counted on the simulated GPU (accelerator.host_syncs): a host read
(.item(), bool(), .tolist(), to_host), a host<->device copy CUDA runs synchronously (pageable memory, or no
non_blocking), a full device sync. A step has one: its read of the loss and the norm, after which the optimizer
and the next step's work are queued without waiting; the next step's batch is already on its way (prefetched
before the read). The ranks' agreement on a stop signal rides on that read (trainer/signals.py), and the step's time
spans its optimizer, timed without a sync of its own. transformers' packed-sequence check (a `.all()` per forward on position_ids) is not run: the
per-document attention registers no mask function (model/attention_mask.py)."""
from __future__ import annotations

import contextlib
import functools
import signal
import tempfile
from types import SimpleNamespace

import pytest

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.plan.simulate import _simulated_world

STEP_READ = ("to_host", "shardtune.trainer.train:train_step")


@contextlib.contextmanager
def stop_request():
    """A StopRequest (trainer/signals.py) whose signal handlers are this test's only: pytest's are put back."""
    from shardtune.trainer.signals import StopRequest

    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    saved = [signal.getsignal(s) for s in signals]
    try:
        yield StopRequest()
    finally:
        for s, handler in zip(signals, saved, strict=True):
            signal.signal(s, handler)


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny-cpu", []),  # full fine-tuning, vocab-parallel tables
    ("tiny-cpu", ["engine.cpu_offload=true"]),
    ("tiny-lora-cpu", ["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=1", "engine.cpu_offload=true"]),
    ("tiny-dpo-cpu", ["dpo.precompute_reference=true"]),  # the reference log-probs copied per micro-step
])
def test_one_host_sync_per_step(recipe: str, overrides: list[str]) -> None:
    from shardtune.trainer.train import setup, train_step

    with tempfile.TemporaryDirectory() as tmp, _simulated_world(2, 1), stop_request() as stop:
        recipe = load_recipe(recipe, ["launch.device=cuda", "train.grad_accum=3", "train.micro_batch_size=2",
                                      "data.num_samples=200", f"train.output_dir={tmp}", *overrides])
        run = setup(recipe, simulated=True)
        run.model.train()
        for step in range(2):  # the first step copies its own batch; the second finds it prefetched
            accelerator.TRACE.clear()
            stop.signum = signal.SIGTERM if step else None  # a vote to agree on costs no sync of its own
            record = train_step(run, step, None, stop)
            assert accelerator.host_syncs() == [STEP_READ]
            assert run.prefetched is not None and run.prefetched[0] == step + 1  # the next batch is on its way
            assert record["loss"] == 0.0 and record["step_time_s"] > 0  # meta: values read as zeros


@pytest.mark.parametrize("overrides", [[], ["engine.cpu_offload=true"]])  # the host AdamW too
def test_step_time_spans_the_optimizer(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """step_time_s and tokens_per_s run from the step's start to after optimizer.step, zero_grad and the scheduler's
    step: a fake clock that only those advance (no real timing)."""
    import shardtune.trainer.train as T

    clock = [0.0]
    monkeypatch.setattr(T, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def advancing(fn, seconds: float):
        @functools.wraps(fn)  # keeps the scheduler's mark on optimizer.step
        def call(*args, **kwargs):
            clock[0] += seconds
            return fn(*args, **kwargs)
        return call

    with tempfile.TemporaryDirectory() as tmp, _simulated_world(2, 1):
        recipe = load_recipe("tiny-cpu", ["launch.device=cuda", "train.grad_accum=2", "data.num_samples=200",
                                          f"train.output_dir={tmp}", *overrides])
        run = T.setup(recipe, simulated=True)
        run.model.train()
        monkeypatch.setattr(run.optimizer, "step", advancing(run.optimizer.step, 4.0))
        monkeypatch.setattr(run.optimizer, "zero_grad", advancing(run.optimizer.zero_grad, 0.5))
        monkeypatch.setattr(run.scheduler, "step", advancing(run.scheduler.step, 0.25))
        record = T.train_step(run, 0, None)
    assert record["step_time_s"] == 4.75
    assert record["tokens_per_s"] == record["tokens"] / 4.75
