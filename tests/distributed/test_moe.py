"""Mixture of experts through the real trainer (train.setup + train.train_step, the tiny-moe-cpu recipe with the
product's defaults: vocab_parallel on, shard_adapter_states on): fp32, 8 steps, per-step loss and grad norm of
1 rank x 4 micro-steps = 2 ranks x 2 = 4 ranks x 1 (full_shard and hybrid 2x2), within 1e-5, for full fine-tuning,
LoRA (attention + every expert) and QLoRA (NF4 experts), on tiny Qwen3-MoE, Mixtral and gpt-oss, and full
fine-tuning with the routers' balance loss (train.router_aux_loss_coef). One spawn per world size."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from tests.distributed.harness import run_distributed

from shardtune.config.load import load_recipe
from shardtune.trainer.train import setup, train_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
TOL = 1e-5
MODELS = ("tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss")
MODES = {"full": [], "lora": ["lora.enabled=true", "lora.r=4"],
         "qlora": ["lora.enabled=true", "lora.r=4", "lora.quantize_base=nf4"],
         "aux": ["train.router_aux_loss_coef=0.05"]}  # full fine-tuning + the routers' balance loss (not a default)
CASES = [(m, mode) for m in MODELS for mode in ("full", "lora", "qlora")] + [("tiny-qwen3-moe", "aux")]
ATTENTION = {"tiny-gpt-oss": ["model.attn_implementation=eager"]}  # its attention sinks have no sdpa path


def _steps(tmp: str, model: str, mode: str, strategy: str, accum: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what torchrun would set
    name = f"{model}-{mode}-{strategy}-w{world}"
    recipe = load_recipe(REPO / "recipes" / "tiny-moe-cpu.yaml", [
        f"model.config={REPO}/configs/models/{model}.json", f"engine.strategy={strategy}", "engine.hybrid_shard_size=2",
        "data.num_samples=200", "data.seq_len=32", f"data.cache_dir={tmp}/cache", f"train.output_dir={tmp}/{name}",
        "train.micro_batch_size=1", f"train.grad_accum={accum}", f"train.max_steps={STEPS}", "train.warmup_steps=0",
        "train.demo_eval=false", "train.eval_every=0", *MODES[mode], *ATTENTION.get(model, [])])
    run = setup(recipe)
    records = [train_step(run, s, None) for s in range(STEPS)]
    if rank == 0:
        Path(tmp, f"{name}.json").write_text(json.dumps([{k: r[k] for k in ("loss", "grad_norm")} for r in records]))


def _settings(tmp: str, strategies: list[str], accum: int) -> list[dict]:
    return [dict(tmp=tmp, model=m, mode=mode, strategy=s, accum=accum) for m, mode in CASES for s in strategies]


def test_moe_parity_across_world_sizes(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_steps, 1, _settings(tmp, ["full_shard"], 4))
    run_distributed(_steps, 2, _settings(tmp, ["full_shard"], 2))
    run_distributed(_steps, 4, _settings(tmp, ["full_shard", "hybrid_shard"], 1))
    for model, mode in CASES:
        ref = json.loads((tmp_path / f"{model}-{mode}-full_shard-w1.json").read_text())
        assert ref[-1]["loss"] < ref[0]["loss"], (model, mode)  # it trains
        for other in ("full_shard-w2", "full_shard-w4", "hybrid_shard-w4"):
            got = json.loads((tmp_path / f"{model}-{mode}-{other}.json").read_text())
            worst = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(ref, got, strict=True) for k in a)
            print(f"{model:<15} {mode:<6} {other:<15} loss {ref[0]['loss']:.4f} -> {ref[-1]['loss']:.4f}  "
                  f"max relative deviation {worst:.1e}")  # the figures (pytest -s)
            for step, (a, b) in enumerate(zip(ref, got, strict=True)):
                for k in a:
                    assert abs(a[k] - b[k]) <= TOL * max(1.0, abs(a[k])), (model, mode, other, step, k, a[k], b[k])
    full, aux = (json.loads((tmp_path / f"tiny-qwen3-moe-{m}-full_shard-w1.json").read_text()) for m in ("full", "aux"))
    assert aux[0]["loss"] > full[0]["loss"]  # the balance loss is in the loss (~coef per token at step 1)
