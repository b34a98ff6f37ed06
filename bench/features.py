"""Issue-4 features side by side on 2 CPU ranks (gloo), one run: activation checkpointing (memory, step time),
CPU offload (step time), LoRA vs full fine-tuning (memory).

    .venv/bin/python bench/features.py                       # 8-layer, hidden 512 Llama (~31 M params), ~3 min
    .venv/bin/python bench/features.py --layers 4 --steps 3  # quicker

Each pair is built, stepped and measured in the same process, alternating the two settings step by step (order
flipped every step) so the machine's load hits both equally. fp32 throughout (bf16 matmuls are emulated on this CPU).
- peak MiB: peak live tensor bytes of a rank during one untimed training step (shardtune.memory.CpuMemoryTracker),
  max over ranks; "activation MiB" = peak minus the bytes alive just before the forward (states, gathered root).
- step s: median over the timed steps of forward + backward + clip + AdamW step, slower rank (barriers around).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.engine.api import ShardingPolicy
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.shard import shard_model
from shardtune.memory import CpuMemoryTracker
from shardtune.model.lora import is_adapter

SETTINGS = {  # name -> (activation checkpointing, cpu offload, lora)
    "base": (False, False, False),
    "ckpt": (True, False, False),
    "offload": (False, True, False),
    "lora": (False, False, True),
}
PAIRS = [("checkpointing", "base", "ckpt"), ("cpu offload", "base", "offload"), ("LoRA vs full", "base", "lora")]


def build(a: argparse.Namespace, setting: str):
    ckpt, offload, lora = SETTINGS[setting]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 128, max_position_embeddings=a.seq, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if lora:
        get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    policy = ShardingPolicy(unit_classes=(LlamaDecoderLayer,), cpu_offload=offload,
                            replicated=(lambda n, p: is_adapter(n)) if lora else None)
    if ckpt:
        apply_activation_checkpointing(model, policy.unit_classes)
    sharded = shard_model(model, policy, device=torch.device("cpu"))
    opt = torch.optim.AdamW(sharded.optimizer_param_groups(0.1), lr=1e-4, foreach=True)
    return model, sharded, opt


def step(a, model, sharded, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, a.vocab, (a.batch * dist.get_world_size(), a.seq), generator=g)
    ids = ids.chunk(dist.get_world_size())[dist.get_rank()]
    logits = model(input_ids=ids, use_cache=False).logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, a.vocab), ids[:, 1:].reshape(-1), reduction="sum") / ids.numel()
    del logits
    loss.backward()
    sharded.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def max_over_ranks(x: float) -> float:
    t = torch.tensor(float(x))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_memory(a, setting: str) -> tuple[float, float]:
    model, sharded, opt = build(a, setting)
    step(a, model, sharded, opt, 0)  # AdamW state exists from here on
    tracker = CpuMemoryTracker().start()
    before = tracker.live_bytes()
    step(a, model, sharded, opt, 1)
    peak = tracker.peak_bytes()
    tracker.stop()
    return max_over_ranks(peak / 2**20), max_over_ranks((peak - before) / 2**20)


def worker(rank: int, world: int, store: str, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=20))
    rows = []
    for title, left, right in PAIRS:
        built = {s: build(a, s) for s in (left, right)}
        times: dict[str, list[float]] = {left: [], right: []}
        for i in range(a.steps + 1):
            for s in ((left, right) if i % 2 == 0 else (right, left)):
                dist.barrier()
                t0 = time.perf_counter()
                step(a, *built[s], i)
                dist.barrier()
                if i > 0:  # the first step is warm-up (lazy AdamW state)
                    times[s].append(time.perf_counter() - t0)
        del built
        mem = {s: measure_memory(a, s) for s in (left, right)}
        rows.append((title, left, right, {s: statistics.median(times[s]) for s in times}, mem))
    if rank == 0:
        print("| comparison | setting | step s | ratio | peak MiB | ratio | activation MiB | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for title, left, right, t, mem in rows:
            for s in (left, right):
                r = s == right
                print(f"| {title} | {s} | {t[s]:.3f} | {t[s] / t[left]:.2f} | {mem[s][0]:.1f} | "
                      f"{mem[s][0] / mem[left][0]:.2f} | {mem[s][1]:.1f} | "
                      f"{mem[s][1] / mem[left][1]:.2f} |" if r else
                      f"| {title} | {s} | {t[s]:.3f} | 1 | {mem[s][0]:.1f} | 1 | {mem[s][1]:.1f} | 1 |")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per setting")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "store"), a), nprocs=2, join=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
