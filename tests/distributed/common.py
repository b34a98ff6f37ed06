"""Shared pieces of the distributed tests: tiny models, a fixed global batch, the reference loop."""
from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.dtypes import DTYPE_NAMES
from shardtune.config.schema import EngineConfig, LoraConfig, Recipe
from shardtune.engine.api import ShardingPolicy, default_no_weight_decay
from shardtune.trainer.parallelize import sharding_policy

MODELS = ("tiny-llama", "tiny-qwen2")
T = TypeVar("T")


def computed_by_one_rank(key: str, compute: Callable[[], T]) -> T:
    """`compute()` (a single-process reference: losses, trained tensors) on one rank, picked by `key`, and its result
    sent to the others, instead of every rank computing the same thing: at 4 ranks on 2 cores that was 3 wasted
    copies of the reference run. Every rank calls it at the same point (the grids' settings run in lockstep)."""
    owner = zlib.crc32(key.encode()) % dist.get_world_size()
    box = [compute() if dist.get_rank() == owner else None]
    dist.broadcast_object_list(box, src=owner)
    return box[0]


def build_model(name: str, *, seed: int = 0, **config: object) -> nn.Module:
    """`config`: HF config fields to change (num_hidden_layers=1)."""
    path = CONFIGS_DIR / "models" / f"{name}.json"
    cfg = AutoConfig.from_pretrained(str(path), **config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def global_batch(step: int, *, num_seqs: int = 8, seq_len: int = 16, vocab: int = 128) -> tuple[torch.Tensor, ...]:
    """Same on every rank. Labels have some ignored positions so target counts differ per sequence."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (num_seqs, seq_len), generator=g)
    labels = ids.clone()
    labels[torch.rand(num_seqs, seq_len, generator=g) < 0.2] = -100
    return ids, labels


def token_loss_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def num_targets(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def policy_for(model: nn.Module, strategy: str, *, world: int, param_dtype: torch.dtype = torch.float32,
               reduce_dtype: torch.dtype = torch.float32, lora: str | None = None, **engine: Any) -> ShardingPolicy:
    """What train runs (parallelize.sharding_policy) for the recipe schema's defaults plus the stated settings:
    `strategy` (hybrid: shard groups of 2), the dtypes, `lora` ("lora", or "nf4" for QLoRA) and `engine`, any other
    engine.* key (prefetch=False)."""
    recipe = Recipe(engine=EngineConfig(strategy=strategy, hybrid_shard_size=2 if strategy == "hybrid_shard" else None,
                                        mixed_precision=DTYPE_NAMES[param_dtype],
                                        reduce_dtype=DTYPE_NAMES[reduce_dtype], **engine),
                    lora=LoraConfig(enabled=lora is not None, quantize_base="nf4" if lora == "nf4" else None))
    return sharding_policy(recipe, model, world_size=world)


def adamw(groups_or_model, weight_decay: float = 0.1) -> torch.optim.AdamW:
    if isinstance(groups_or_model, nn.Module):
        decay, no_decay = [], []
        for n, p in groups_or_model.named_parameters():
            (no_decay if default_no_weight_decay(n, p) else decay).append(p)
        groups_or_model = [{"params": decay, "weight_decay": weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups_or_model, lr=1e-3, betas=(0.9, 0.95), foreach=True)


def train_step(model: nn.Module, sharded, opt, step: int, *, accum: int, sync_each: bool,
               max_grad_norm: float = 1.0, before_step=None, device: str = "cpu", all_reduce_once: bool = False,
               between_micro_steps=None) -> tuple[float, torch.Tensor]:
    """One optimizer step over the global batch; this rank takes its slice of each micro-batch.
    Loss per micro-batch = sum CE / global target tokens, so summed gradients equal the single-process ones.
    `all_reduce_once`: replicated grads (adapters) reduced on the last micro-step only, as the trainer does."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded is not None else (0, 1)
    ids, labels = global_batch(step)
    total = num_targets(labels)
    loss_sum = torch.zeros((), device=device)
    for m, (mi, ml) in enumerate(zip(ids.chunk(accum), labels.chunk(accum), strict=True)):
        mi, ml = mi.chunk(world)[rank].to(device), ml.chunk(world)[rank].to(device)
        if sharded is not None:
            sharded.set_requires_gradient_sync(sync_each or m == accum - 1)
            if all_reduce_once:
                sharded.set_requires_all_reduce(m == accum - 1)
        loss = token_loss_sum(model, mi, ml) / total
        loss.backward()
        loss_sum += loss.detach()
        if between_micro_steps is not None and m < accum - 1:
            between_micro_steps()
    if sharded is not None:
        dist.all_reduce(loss_sum)
        norm = sharded.clip_grad_norm_(max_grad_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss_sum), norm


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


@contextlib.contextmanager
def nf4_chunks_relative() -> Iterator[None]:
    """NF4 quantization chunks at 1/64 of each weight, down to one block: nf4.FLOOR (at least ~3 MiB of chunk
    temporaries, for speed) is above every weight of the tiny models, whose loading peaks the tests bound relative to
    their weights, as a real model's is bounded (its weights, of >= 4M elements, are all above the floor)."""
    from shardtune.engine import nf4

    floor, nf4.FLOOR = nf4.FLOOR, nf4.BLOCK
    try:
        yield
    finally:
        nf4.FLOOR = floor
