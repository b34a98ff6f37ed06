"""Our engine (backend=shardtune) vs PyTorch FSDP2 (backend=torch), side by side on 2 CPU ranks (gloo).

    .venv/bin/python bench/engine_vs_fsdp2.py                 # 31 M-param Llama, fp32 and bf16, ~4 min
    .venv/bin/python bench/engine_vs_fsdp2.py --dtypes fp32 --layers 4   # quicker
    .venv/bin/python bench/engine_vs_fsdp2.py --vocab-parallel   # engine.vocab_parallel + the chunked loss on both

Self-contained: builds a Llama-architecture model from a config written here, drives both engines with its own
training loop (sum CE / global target tokens, AdamW, clipping), and prints a markdown table:
- median step time, ours / FSDP2 (steps alternate between the two backends, order flipped every step, so drift
  from the other load on the machine hits both equally);
- peak live tensor bytes of the whole rank during one training step (params, grads, AdamW state, gathered
  units, activations; the CPU tracker in shardtune.memory), ours / FSDP2, max over ranks; measured after the timed
  steps with only one backend's model alive, in an untimed step (tracking slows ops);
- our measured comm bytes per step (forward + backward) against ring theory.
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
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.config.dtypes import DTYPES
from shardtune.engine import shard as ours_backend
from shardtune.engine import torch_backend
from shardtune.engine.api import MixedPrecision, ShardingPolicy, ShardingStrategy
from shardtune.memory import CpuMemoryTracker

BACKENDS = {"shardtune": ours_backend, "fsdp2": torch_backend}


def llama_config(a: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3 // 64 * 64,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                       num_key_value_heads=a.hidden // 128, max_position_embeddings=a.seq,
                       tie_word_embeddings=False)


def build(a: argparse.Namespace, backend: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(a), attn_implementation="sdpa")
    policy = ShardingPolicy(strategy=ShardingStrategy.FULL_SHARD, unit_classes=(LlamaDecoderLayer,),
                            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
                            # --vocab-parallel: ours row-shards the tables, FSDP2 makes them units of their own
                            vocab_parallel=a.vocab_parallel)
    sharded = BACKENDS[backend].shard_model(model, policy, device=torch.device("cpu"))
    # The optimizer trainer/train.py builds for host states (build_optimizer: fused on CPU): foreach would add a temporary
    # copy of every shard to the optimizer phase (its _foreach_sqrt), which no training run pays.
    opt = torch.optim.AdamW(sharded.optimizer_param_groups(0.1), lr=1e-4, fused=True)
    return model, sharded, opt


def batch(a: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's slice of a fixed global batch, and the global number of target tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, a.vocab, (a.batch * dist.get_world_size(), a.seq), generator=g)
    return ids.chunk(dist.get_world_size())[dist.get_rank()], ids, ids[:, 1:].numel()


def train_step(a, model, sharded, opt, step: int) -> tuple[float, int]:
    ids, _, total = batch(a, step)
    if a.vocab_parallel:  # the product's defaults: the chunked loss (1024 tokens), on the row-sharded head for ours
        from shardtune.engine.loss import token_loss_sum

        pos = torch.arange(ids.shape[1]).expand_as(ids)
        logits = None
        loss = token_loss_sum(model, ids, ids, pos, chunk_tokens=1024) / total
    else:
        logits = model(input_ids=ids).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, a.vocab), ids[:, 1:].reshape(-1), reduction="sum") / total
    before = sharded.comm_bytes()
    loss.backward()
    del logits
    comm = sharded.comm_bytes() - before  # backward only; forward counted by the caller via totals
    sharded.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    dist.all_reduce(loss)
    return float(loss), comm


def ring(numel: int, elem: int, world: int) -> int:
    return 2 * (world - 1) * numel * elem // world


def theory_bytes(sharded, dtype: torch.dtype, world: int) -> int:
    """full_shard, fwd+bwd: every unit gathered in forward, again in backward except the last block and the
    root (kept), one reduce-scatter (fp32) of every trainable buffer."""
    ag = torch.tensor([], dtype=dtype).element_size()
    numels = [sum(p) for p in sharded.padded_numels()]
    *blocks, root = numels
    gathers = sum(numels) + sum(blocks[:-1])
    return ring(gathers, ag, world) + ring(sum(numels), 4, world)


def worker(rank: int, world: int, store_path: str, a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    for dtype_name in a.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        runs = {b: build(a, b, dtype) for b in BACKENDS}
        nparams = sum(f.numel for u in runs["shardtune"][1].units for f in u.flats)  # vocab tables included
        times: dict[str, list[float]] = {b: [] for b in BACKENDS}
        losses: dict[str, list[float]] = {b: [] for b in BACKENDS}
        comm = 0
        steps = a.bf16_steps if dtype == torch.bfloat16 else a.steps  # CPU bf16 matmuls are emulated: ~9x slower
        for i in range(a.warmup + steps):
            order = list(BACKENDS) if i % 2 == 0 else list(BACKENDS)[::-1]
            for b in order:
                model, sharded, opt = runs[b]
                dist.barrier()
                t0 = time.perf_counter()
                c0 = sharded.comm_bytes()
                loss, _ = train_step(a, model, sharded, opt, i)
                dist.barrier()
                if i >= a.warmup:
                    times[b].append(time.perf_counter() - t0)
                losses[b].append(loss)
                if b == "shardtune":
                    comm = sharded.comm_bytes() - c0
        theory = theory_bytes(runs["shardtune"][1], dtype, world)
        del runs, model, sharded, opt
        peaks = {}
        for b in BACKENDS:  # one backend alive at a time; untimed: the tracker costs Python work per op
            model, sharded, opt = build(a, b, dtype)
            train_step(a, model, sharded, opt, 0)  # optimizer states exist from here on, as in training
            tracker = CpuMemoryTracker(record_peak=a.peak_list > 0).start()
            tracker.reset_peak()
            train_step(a, model, sharded, opt, 1)
            peak = torch.tensor(tracker.peak_bytes())
            tracker.stop()
            if a.peak_list and rank == 0:
                print_peak_list(f"{b} {dtype_name}", tracker.peak_live, a.peak_list)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[b] = int(peak)
            del model, sharded, opt
        clip_bytes = 2 * ring(1, 4, world)  # the scalar all-reduce of clipping, as counted
        loss_diff = max(abs(x - y) / abs(y) for x, y in zip(losses["shardtune"], losses["fsdp2"], strict=True))
        med = {b: statistics.median(times[b]) for b in BACKENDS}
        rows.append((dtype_name, nparams, med, peaks, comm, theory, clip_bytes, loss_diff))
    if rank == 0:
        print_table(a, rows)
    dist.destroy_process_group()


def print_peak_list(title: str, live: list[tuple[str, int]], top: int) -> None:
    """Rank 0's live storages at its peak, grouped by the op/shape/dtype that created them, largest first."""
    groups: dict[str, list[int]] = {}
    for label, n in live:
        groups.setdefault(label, []).append(n)
    total = sum(n for _, n in live)
    print(f"\nlive at the peak, {title}: {total / 2**20:.3f} MiB in {len(live)} storages", flush=True)
    for label, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(sizes) / 2**20:8.3f} MiB  {len(sizes):4d} x  {label}", flush=True)


def print_table(a: argparse.Namespace, rows) -> None:
    mib = 2 ** 20
    print(f"\nLlama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; {a.batch}x{a.seq} tokens/rank/step; "
          f"2 ranks x {a.threads} thread(s), gloo; full_shard; {a.warmup} warmup + {a.steps} (fp32) / "
          f"{a.bf16_steps} (bf16) timed steps per backend\n")
    print("| dtype | params | step s (ours) | step s (FSDP2) | time ratio | peak MiB (ours) | peak MiB (FSDP2) "
          "| memory ratio | comm MB/step (ours) | theory MB/step | max rel loss diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, n, med, peaks, comm, theory, clip, diff in rows:
        print(f"| {dtype} | {n / 1e6:.1f} M | {med['shardtune']:.3f} | {med['fsdp2']:.3f} | "
              f"**{med['shardtune'] / med['fsdp2']:.3f}** | {peaks['shardtune'] / mib:.1f} | "
              f"{peaks['fsdp2'] / mib:.1f} | **{peaks['shardtune'] / peaks['fsdp2']:.3f}** | "
              f"{comm / 1e6:.2f} | {(theory + clip) / 1e6:.2f} | {diff:.1e} |")
    print("\ncomm theory = ring all-gather of every unit in forward + again in backward except the last block and "
          "the root + fp32 reduce-scatter of every unit + the clipping scalar; FSDP2 (no byte counter) also "
          "re-gathers the last block.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=6, help="timed fp32 steps per backend")
    p.add_argument("--bf16-steps", type=int, default=3, help="timed bf16 steps per backend")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks share the cores)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="engine.vocab_parallel on both backends, and the chunked loss (the product's defaults)")
    p.add_argument("--peak-list", type=int, default=0, help="print the N largest groups of live tensors at the peak")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "store"), a), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
