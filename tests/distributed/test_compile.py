"""engine.compile=true trains what eager trains: the real trainer (train.setup + train.train_step) at 2 ranks, fp32,
4 steps, per-step loss within 1e-5 of the eager run of the same recipe, with no graph break inside a decoder block
(fullgraph=True raises on one), and one compile per block class for the whole run, across sequence lengths. One
spawn for the grid: dense, LoRA, QLoRA, MoE, packed rows. What validate still refuses: tests/unit/test_compile_refusals.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from tests.distributed.harness import run_distributed

from shardtune.config.load import load_recipe
from shardtune.engine import compile as compile_module
from shardtune.trainer.train import setup, train_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
TOL = 1e-5
FP32 = ["engine.mixed_precision=fp32", "engine.cpu_offload=false", "model.dtype=fp32"]
# Graphs per run for the one decoder-block class: LoRA's first block takes an input with no gradient (the frozen
# embedding's output), every later block one with a gradient, and dynamo guards on requires_grad: one graph each.
CASES = {"dense": ("tiny-cpu", [], 1),
         "lora": ("tiny-lora-cpu", FP32, 2),  # activation checkpointing on: the recompute calls the compiled block
         "qlora": ("tiny-qlora-cpu", FP32, 2),  # NF4 base: engine/nf4_linear.py's nf4_linear_op, one node per Linear
         "moe": ("tiny-moe-cpu", [], 1),  # routed experts: model/experts.py grouped_mm_op, its weight gradients included
         # documents as a tensor (model/attention.py document_attention_op); rows of 96 tokens hold several of them
         "packed": ("tiny-cpu", ["data.packing=true", "data.seq_len=96"], 1)}
SEQ_LENS = (32,)


def _unpatch_bf16_gemm() -> None:
    """tests/bf16_gemm.py (imported by the rank server) registers SDPA's CPU kernels at BackendSelect, which
    FakeTensor tracing dispatches through to the real kernel (data not allocated). Every run here is fp32, which
    those kernels pass on unchanged: drop them in this rank (a forked rank of its own)."""
    import tests.bf16_gemm as bf16_gemm

    if bf16_gemm._LIB.m is not None:
        bf16_gemm._LIB._destroy()


def _steps(tmp: str, case: str, compiled: bool, seq_len: int) -> None:
    import torch._dynamo

    _unpatch_bf16_gemm()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what torchrun would set
    recipe_name, overrides, _ = CASES[case]
    name = f"{case}-{'compiled' if compiled else 'eager'}-{seq_len}"
    recipe = load_recipe(REPO / "recipes" / f"{recipe_name}.yaml", [
        "data.num_samples=200", f"data.seq_len={seq_len}", "data.packing=false", f"data.cache_dir={tmp}/cache",
        f"train.output_dir={tmp}/{name}", "train.micro_batch_size=1", f"train.max_steps={STEPS}",
        "train.warmup_steps=0", "train.demo_eval=false", "train.eval_every=0", f"engine.compile={str(compiled).lower()}",
        *overrides])
    torch._dynamo.reset()  # count this run's compiles from zero
    torch._dynamo.utils.counters.clear()
    run = setup(recipe)
    records, layouts = [], []
    for s in range(STEPS):
        records.append(train_step(run, s, None))
        if compiled and recipe.data.packing:  # the documents the compiled blocks were handed (engine/compile.py)
            layouts.append([n for n in compile_module._LAST[0][1][0].tolist() if n])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if rank == 0:
        Path(tmp, f"{name}.json").write_text(json.dumps({"loss": [r["loss"] for r in records], "graphs": graphs,
                                                         "layouts": layouts}))


def test_compiled_blocks_train_what_eager_trains(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_steps, 2, [dict(tmp=tmp, case=c, compiled=x, seq_len=n)
                                for c in CASES for x in (False, True) for n in SEQ_LENS], timeout_s=600)
    for case in CASES:
        for n in SEQ_LENS:
            eager, compiled = (json.loads((tmp_path / f"{case}-{k}-{n}.json").read_text())
                               for k in ("eager", "compiled"))
            assert eager["graphs"] == 0
            # The run's 4 steps, every row padded to data.seq_len: no compile per step or per batch.
            assert compiled["graphs"] == CASES[case][2], (case, n, compiled["graphs"])
            for step, (a, b) in enumerate(zip(eager["loss"], compiled["loss"], strict=True)):
                assert abs(a - b) <= TOL * max(1.0, abs(a)), (case, n, step, a, b)
    # packed: rows of several documents, a different layout every step, and still the one graph
    layouts = json.loads((tmp_path / f"packed-compiled-{SEQ_LENS[0]}.json").read_text())["layouts"]
    assert len(layouts) == STEPS and min(map(len, layouts)) >= 3, layouts
    assert len({tuple(x) for x in layouts}) == STEPS, layouts
