"""Eval loss and the demo's held-out exact-match accuracy. Every rank runs the same number of forwards:
the sharded model's collectives need all ranks, so short shards are padded with weight-0 rows."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from shardtune import accelerator
from shardtune.accelerator import to_device
from shardtune.data.batches import RowSource, num_targets
from shardtune.data.packing import doc_lengths
from shardtune.engine.loss import token_loss_sum
from shardtune.model import context_parallel
from shardtune.trainer.decode import greedy_decode
from shardtune.trainer.runtime import Runtime

MAX_DEMO_TOKENS = 128  # greedy decoding per held-out prompt, at most


@torch.no_grad()
def eval_loss(model: nn.Module, rows: RowSource, rt: Runtime, *, micro_batch_size: int, max_rows: int,
              loss_chunk_tokens: int = 0) -> float | None:
    n = min(len(rows), max_rows)
    if n == 0:
        return None
    was_training = model.training
    model.eval()
    # The loss summed on the device and read once at the end (a read per batch would stall the CPU per forward);
    # the target count is the host labels'.
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    count = 0.0
    rank, world = context_parallel.data_rank(rt.rank, rt.world_size)  # engine.context_parallel: a group, one row
    counts = context_parallel.counts_rows()  # its ranks each sum their part of the loss; one counts the targets
    chunk = micro_batch_size * world
    for start in range(0, n, chunk):
        idx = torch.arange(start + rank * micro_batch_size, start + (rank + 1) * micro_batch_size)
        idx = idx[idx < n]
        weight = 1.0 if len(idx) else 0.0
        if not len(idx):
            idx = torch.tensor([0])  # a dummy forward keeps the collectives in step
        host = rows.take(idx.numpy())
        ids, labels, pos = (to_device(torch.from_numpy(x), rt.device) for x in host)
        s = token_loss_sum(model, ids, labels, pos, chunk_tokens=loss_chunk_tokens, doc_lengths=doc_lengths(host[2]))
        loss_sum = loss_sum + weight * s.detach().double()
        count += weight * num_targets(host[1]) * counts
    model.train(was_training)
    sums = torch.stack([loss_sum, torch.full((), count, dtype=torch.float64, device=rt.device)])
    dist.all_reduce(sums)
    loss_total, count_total = accelerator.to_host(sums).tolist()  # the one host read
    return loss_total / max(count_total, 1.0)


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
    from shardtune.templates import render_prompt

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
    tie differently): `greedy_decode` keeps the ranks in lockstep."""
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
    # Ranks in lockstep (every forward gathers parameters), at most max_new_tokens forwards (trainer/decode.py)
    out = greedy_decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, world_size=rt.world_size)
    texts = tok.batch_decode(accelerator.to_host(out[:, enc["input_ids"].shape[1]:]), skip_special_tokens=False)
    correct = sum(t.split(tok.eos_token or "\0")[0].replace(tok.pad_token or "\0", "") == s["response"]
                  for t, s in zip(texts, samples))
    model.train(was_training)
    return correct / len(samples)


def accuracy_before(model: nn.Module, tok: PreTrainedTokenizerBase, samples: list[dict[str, Any]], rt: Runtime, *,
                    start_step: int, recorded: dict[str, Any] | None) -> tuple[float | None, str]:
    """The demo's "before" accuracy and what the summary line says it is. A fresh run measures it at step 0. A
    resumed run reports the one its first launch measured at step 0 (`recorded`: the checkpoint carries it), so
    before -> after is the whole run's, as without the resume; a checkpoint without it (written before it was
    recorded, or demo_eval was off then, or over another number of samples) is measured now, at the resumed step."""
    if not samples:
        return None, ""
    if start_step == 0:
        return exact_match(model, tok, samples, rt), ""
    if recorded is not None and recorded.get("samples") == len(samples):
        return recorded["accuracy"], f" (at step 0, recorded before the resume at step {start_step})"
    return exact_match(model, tok, samples, rt), f" (at step {start_step}, where this run resumed)"
