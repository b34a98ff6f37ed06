"""Eval loss and the demo's held-out exact-match accuracy. Every rank runs the same number of forwards:
the sharded model's collectives need all ranks, so short shards are padded with weight-0 rows."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from shardtune.attention import doc_lengths
from shardtune.data.batches import RowSource
from shardtune.data.formats import IGNORE
from shardtune.loss import token_loss_sum
from shardtune.runtime import Runtime, all_reduce_sum

MAX_DEMO_TOKENS = 128  # greedy decoding per held-out prompt, at most


@torch.no_grad()
def eval_loss(model: nn.Module, rows: RowSource, rt: Runtime, *, micro_batch_size: int, max_rows: int,
              loss_chunk_tokens: int = 0) -> float | None:
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
        host = rows.take(idx.numpy())
        ids, labels, pos = (torch.from_numpy(x).to(rt.device) for x in host)
        s = token_loss_sum(model, ids, labels, pos, chunk_tokens=loss_chunk_tokens, doc_lengths=doc_lengths(host[2]))
        loss_sum += weight * float(s)
        count += weight * float((labels[:, 1:] != IGNORE).sum())
    model.train(was_training)
    loss_sum, count = all_reduce_sum([loss_sum, count], rt.device)
    return loss_sum / max(count, 1.0)


def demo_samples(data: Any, limit: int, *, announce: bool) -> list[dict[str, str]]:
    """Held-out {prompt, response} pairs for `exact_match`, the prompt rendered with the data's template exactly as
    in training. Only a single instruction-format dataset has such pairs; otherwise nothing, with a one-line note."""
    fields = data.manifest.get("data", {})
    why = ("a mix of datasets" if data.parts else f"data.format={fields.get('format')} has no prompt/response pairs"
           if fields.get("format") != "instruction" else "no held-out rows (data.eval_fraction)" if not data.eval_raw
           else None)
    if why is not None:
        if announce:
            print(f"train.demo_eval: skipped ({why})", flush=True)
        return []
    from shardtune.data.templates import render_prompt

    def text(row: dict[str, Any], key: str) -> str:
        value = row.get(fields[key]) if fields[key] else None
        return "" if value is None else str(value)

    return [{"prompt": render_prompt(fields["template"], text(r, "prompt_field"), text(r, "input_field")),
             "response": text(r, "response_field")} for r in data.eval_raw[:limit]]


@torch.no_grad()
def exact_match(model: nn.Module, tok: PreTrainedTokenizerBase, samples: list[dict[str, Any]], rt: Runtime,
                *, max_new_tokens: int | None = None) -> float:
    """Greedy-decode each prompt; a sample counts when the text before EOS equals the response exactly.
    All ranks decode the same prompts, but nothing guarantees they stop at the same step (bf16 kernels may break a
    tie differently): `generate` keeps the ranks in lockstep."""
    if not samples:
        return float("nan")
    if max_new_tokens is None:  # room for the longest expected answer and its EOS (user data: capped)
        lengths = tok([s["response"] for s in samples], add_special_tokens=False)["input_ids"]
        max_new_tokens = min(MAX_DEMO_TOKENS, max(len(x) for x in lengths) + 1)
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
