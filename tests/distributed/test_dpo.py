"""DPO through the real trainer (train.setup + train.train_step): fp32, 1 rank x 4 micro-steps = 2 ranks x 2 =
4 ranks x 1 (full_shard and hybrid 2x2) per step, for LoRA (reference = adapters off) and full fine-tuning
(precomputed reference), and QLoRA at 1 and 2 ranks (reference = the NF4 base); and a checkpoint resumes DPO
exactly, full fine-tuning (after an SFT warm-up, reference read back from the run dir) and LoRA (adapters off). One spawn per world
size."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from tests.distributed.harness import grid, run_distributed

from shardtune.config.load import load_recipe
from shardtune.trainer.train import resume, save_checkpoint, setup, train_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
KEYS = ("loss", "grad_norm", "dpo_loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
TOL = 1e-5


def _recipe(tmp: str, name: str, lora: bool, strategy: str, accum: int, *extra: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what torchrun would set
    return load_recipe(REPO / "recipes" / "tiny-dpo-cpu.yaml", [
        "model.path=null", "model.init=random", f"model.config={REPO}/configs/models/tiny-llama.json",
        f"lora.enabled={lora}", "lora.r=4", "dpo.precompute_reference=null", f"engine.strategy={strategy}",
        "engine.hybrid_shard_size=2", "data.num_samples=120", f"data.cache_dir={tmp}/cache",
        f"train.output_dir={tmp}/{name}", "train.micro_batch_size=1", f"train.grad_accum={accum}",
        f"train.max_steps={STEPS}", "train.lr=1e-2", "train.warmup_steps=0", "train.eval_batches=2",
        "dpo.sft_warmup_steps=0", "dpo.beta=0.1", *extra])


def _dpo_steps(tmp: str, lora: bool, strategy: str, accum: int, qlora: bool = False) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"{'qlora' if qlora else 'lora' if lora else 'full'}-{strategy}-w{world}"
    run = setup(_recipe(tmp, name, lora, strategy, accum, *(["lora.quantize_base=nf4"] if qlora else [])))
    records = [{k: r[k] for k in KEYS} for r in (train_step(run, s, None) for s in range(STEPS))]
    records.append(run.objective.evaluate(run.model, run.rt, global_size=run.batches.global_size))
    if rank == 0:
        Path(tmp, f"{name}.json").write_text(json.dumps(records))


def _dpo_resume(tmp: str, lora: bool) -> None:
    """4 steps straight vs 2 steps, a checkpoint, a fresh trainer resuming it, 2 more: the same records."""
    name = f"resume-{'lora' if lora else 'full'}"
    # full: SFT warm-up, then the precomputed reference; LoRA: DPO from step 1, reference = adapters off
    extra = ("train.max_steps=4", f"dpo.sft_warmup_steps={0 if lora else 1}", "train.resume=auto")
    run = setup(_recipe(tmp, name, lora, "full_shard", 1, *extra))
    straight = [train_step(run, s, None) for s in range(4)]
    run = setup(_recipe(tmp, name + "-b", lora, "full_shard", 1, *extra))
    first = [train_step(run, s, None) for s in range(2)]
    save_checkpoint(run, 2)
    run = setup(_recipe(tmp, name + "-b", lora, "full_shard", 1, *extra))
    assert resume(run) == 2
    resumed = first + [train_step(run, s, None) for s in range(2, 4)]
    for a, b in zip(straight, resumed, strict=True):
        for k in ("loss", "grad_norm", "reward_margin"):
            assert a.get(k) == b.get(k), (name, a["step"], k, a.get(k), b.get(k))
    assert "reward_margin" in straight[-1] and ("reward_margin" in straight[0]) == lora  # full: SFT warm-up first
    assert run.objective.precompute != lora


def _case(resume_test: bool = False, **kw) -> None:
    (_dpo_resume if resume_test else _dpo_steps)(**kw)


def test_dpo_parity_across_world_sizes(tmp_path):
    tmp = str(tmp_path)
    qlora = {"tmp": tmp, "lora": True, "qlora": True, "strategy": "full_shard"}  # reference: the NF4 base
    run_distributed(_dpo_steps, 1, grid(tmp=[tmp], lora=[True, False], strategy=["full_shard"], accum=[4])
                    + [{**qlora, "accum": 4}])
    run_distributed(_case, 2, grid(tmp=[tmp], lora=[True, False], strategy=["full_shard"], accum=[2])
                    + [{**qlora, "accum": 2}, {"resume_test": True, "tmp": tmp, "lora": False},
                       {"resume_test": True, "tmp": tmp, "lora": True}])
    run_distributed(_dpo_steps, 4, grid(tmp=[tmp], lora=[True, False], strategy=["full_shard", "hybrid_shard"],
                                        accum=[1]))
    for kind in ("lora", "full", "qlora"):
        ref = json.loads((tmp_path / f"{kind}-full_shard-w1.json").read_text())
        assert ref[0]["loss"] > 0 and ref[-1]["eval_loss"] > 0
        assert ref[STEPS - 1]["loss"] != ref[0]["loss"]  # it trains
        others = [f"{kind}-full_shard-w2"] + ([] if kind == "qlora" else [f"{kind}-full_shard-w4",
                                                                           f"{kind}-hybrid_shard-w4"])
        for other in others:
            got = json.loads((tmp_path / f"{other}.json").read_text())
            for step, (a, b) in enumerate(zip(ref, got, strict=True)):
                assert a.keys() == b.keys()
                for k in a:
                    assert abs(a[k] - b[k]) <= TOL, (other, step, k, a[k], b[k])
