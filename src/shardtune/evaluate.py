"""Eval loss and the demo's held-out exact-match accuracy. Every rank runs the same number of forwards:
the sharded model's collectives need all ranks, so short shards are padded with weight-0 rows."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from shardtune.data.batches import RowSource
from shardtune.data.formats import IGNORE
from shardtune.runtime import Runtime, all_reduce_sum


def token_loss_sum(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   position_ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens, computed in fp32 (logits upcast)."""
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")


@torch.no_grad()
def eval_loss(model: nn.Module, rows: RowSource, rt: Runtime, *, micro_batch_size: int, max_rows: int) -> float | None:
    n = min(len(rows), max_rows)
    if n == 0:
        return None
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0.0
    chunk = micro_batch_size * rt.world_size
    for start in range(0, n, chunk):
        idx = torch.arange(start + rt.rank * micro_batch_size, start + (rt.rank + 1) * micro_batch_size)
        idx = idx[idx < n]
        weight = 1.0 if len(idx) else 0.0
        if not len(idx):
            idx = torch.tensor([0])  # a dummy forward keeps the collectives in step
        ids, labels, pos = (torch.from_numpy(x).to(rt.device) for x in rows.take(idx.numpy()))
        s = token_loss_sum(model, ids, labels, pos)
        loss_sum += weight * float(s)
        count += weight * float((labels[:, 1:] != IGNORE).sum())
    model.train(was_training)
    loss_sum, count = all_reduce_sum([loss_sum, count], rt.device)
    return loss_sum / max(count, 1.0)


@torch.no_grad()
def exact_match(model: nn.Module, tok: PreTrainedTokenizerBase, samples: list[dict[str, Any]], rt: Runtime,
                *, max_new_tokens: int = 10) -> float:
    """Greedy-decode each prompt; a sample counts when the text before EOS equals the response exactly.
    All ranks decode the same prompts, but nothing guarantees they stop at the same step (bf16 kernels may break a
    tie differently): `generate` keeps the ranks in lockstep."""
    if not samples:
        return float("nan")
    was_training = model.training
    model.eval()
    tok.padding_side = "left"  # decoder-only batched generation pads on the left
    prompts = [(tok.bos_token or "") + s["prompt"] for s in samples]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(rt.device)
    out = generate(model, rt.world_size, **enc, max_new_tokens=max_new_tokens, do_sample=False,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    correct = sum(t.split(tok.eos_token or "\0")[0].replace(tok.pad_token or "\0", "") == s["response"]
                  for t, s in zip(texts, samples))
    model.train(was_training)
    return correct / len(samples)


def generate(model: nn.Module, world_size: int, **kwargs: Any) -> torch.Tensor:
    """`model.generate` on a sharded model (either backend). Every forward gathers parameters with collectives, so a
    rank that stops decoding early (EOS or its own max_new_tokens) would leave the others waiting in an all-gather
    for good. `synced_gpus=True` makes HF keep finished ranks running dummy forwards until every rank is done (one
    all-reduce of a flag per token); the outputs are what each rank alone would produce."""
    return model.generate(**kwargs, synced_gpus=world_size > 1)
