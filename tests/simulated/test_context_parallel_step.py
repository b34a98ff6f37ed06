"""A context-parallel bf16 training step on the simulated GPU (CUDA's branches), issue 58 defects 5 and 6:
  - the attention takes the one varlen call per layer that packed rows take on a GPU, not one SDPA call per document
    piece (model/context_parallel.py);
  - the gradient sums over ranks run in engine.reduce_dtype (fp32 here): the keys' and values' reduce-scatter, and
    the vocabulary-parallel head's hidden-state gradient; the embedding's forward sum (exact in any dtype) stays bf16.
And leaving the simulated world leaves context parallelism off (plan/simulate.py `_simulated_world`).
"""
from __future__ import annotations

import sys
import tempfile

import pytest
import torch

from shardtune.config.load import load_recipe
from shardtune.engine import collectives, vocab
from shardtune.model import attention, context_parallel
from shardtune.plan.simulate import _simulated_world

LAYERS = 4  # tiny-llama
OWNERS = ("GatherSequence", "_Embed", "_Logits", "_CrossEntropy")  # autograd functions that reduce-scatter


def _owner() -> str:
    """The autograd function (and its pass) that issued the reduce-scatter being recorded."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_qualname
        if name.split(".")[0] in OWNERS:
            return name
        frame = frame.f_back
    return "?"


def test_context_parallel_step_on_the_gpu_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardtune.trainer.train import setup, train_step

    calls = {"sdpa": 0, "varlen": 0}
    sdpa, varlen = attention._sdpa, attention.varlen_attn

    def count(kind, fn):
        def counted(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return counted

    sums: list[tuple[str, torch.dtype, torch.dtype]] = []
    reduce_scatter = collectives.reduce_scatter_into

    def recorded(out, full, *a, **k):
        sums.append((_owner(), full.dtype, out.dtype))
        return reduce_scatter(out, full, *a, **k)

    monkeypatch.setattr(attention, "_sdpa", count("sdpa", sdpa))
    monkeypatch.setattr(attention, "varlen_attn", count("varlen", varlen))
    monkeypatch.setattr(collectives, "reduce_scatter_into", recorded)
    monkeypatch.setattr(vocab, "reduce_scatter_into", recorded)
    with tempfile.TemporaryDirectory() as tmp, _simulated_world(2, 1):
        recipe = load_recipe("tiny-cpu", ["launch.device=cuda", "engine.mixed_precision=bf16",
                                          "engine.reduce_dtype=fp32", "engine.context_parallel=true",
                                          "engine.vocab_parallel=true", "train.grad_accum=2",
                                          "train.micro_batch_size=2", "data.num_samples=200",
                                          f"train.output_dir={tmp}"])
        run = setup(recipe, simulated=True)
        assert context_parallel.size() == 2
        run.model.train()
        sums.clear()
        train_step(run, 0, None)
    # the simulated world turns it off on exit (process-wide: later tests in this process run without it)
    assert context_parallel.size() == 1 and not context_parallel.active()
    assert calls == {"sdpa": 0, "varlen": 2 * LAYERS}  # per micro-step, one call per layer
    owners = {owner for owner, _, _ in sums} - {"?"}  # "?": the units' gradient reductions (engine/reduce.py)
    assert owners == {"GatherSequence.backward", "_Embed.forward", "_CrossEntropy.forward"}, owners
    for owner, full, out in sums:
        assert (full, out) == ((torch.bfloat16,) * 2 if owner == "_Embed.forward" else (torch.float32,) * 2), owner
