"""Greedy decoding on a sharded model, bounded on the host: at most `max_new_tokens` forwards whatever the device
reads back. The loop (`decode_tokens`) is shared with GRPO's sampling (trainer/sampling.py), which picks otherwise.

Why not `model.generate`: its loop ends on a host read of the device (`unfinished.max() == 0`, and under
`synced_gpus` an all-reduced flag). A read that never says "done" (the simulated GPU's reads are zeros) loops for
good. Here the number of forwards is a Python range; the device is read only to stop early when every row of every
rank has ended (EOS). On an accelerator that read waits for the queued work, so it comes once every `STOP_EVERY`
tokens, for all of them at once (each forward's ended count, kept on the device): at most STOP_EVERY - 1 forwards
run past the end and their tokens are cut off, so the output is the per-token check's. On the CPU a read costs
nothing: every token. Ranks stay in lockstep, as `synced_gpus` keeps them: every forward gathers parameters with
collectives, so all ranks run the largest `max_new_tokens` of any rank (agreed on the host group, a host number) and
the same early stop (all-reduced counts); a rank past its own budget decodes and drops.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardtune import accelerator
from shardtune.model.attention_mask import generation_attention

STOP_EVERY = 16  # tokens between early-stop reads on an accelerator (module docstring)


@torch.no_grad()
def greedy_decode(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  max_new_tokens: int, pad_token_id: int, eos_token_id: int | None = None,
                  world_size: int = 1, stop_every: int | None = None) -> torch.Tensor:
    """[b, s] prompts (left-padded where `attention_mask` says so) -> [b, s + max_new_tokens] token ids; a row
    that ended (EOS) is padded with `pad_token_id`. Tokens are those of transformers' greedy `generate`."""
    new = decode_tokens(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                        stop_ids=() if eos_token_id is None else (eos_token_id,), world_size=world_size,
                        pick=lambda logits, _: logits.argmax(-1), stop_every=stop_every)
    return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)


@torch.no_grad()
def decode_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  max_new_tokens: int, pad_token_id: int, stop_ids: Sequence[int], world_size: int,
                  pick: Callable[[torch.Tensor, int], torch.Tensor],
                  ended: torch.Tensor | None = None, stop_every: int | None = None) -> torch.Tensor:
    """The loop of greedy and sampled decoding: [b, s] prompts -> [b, <= max_new_tokens] new tokens, token i of
    every row being `pick(logits [b, vocab] fp32, i)`; a row that drew one of `stop_ids` is padded after it with
    `pad_token_id`. `ended` [b] bool: rows that take part in the forwards only (padded from the start).
    `stop_every`: forwards between early-stop reads (default: STOP_EVERY on an accelerator, 1 on the CPU)."""
    from transformers import DynamicCache

    device = input_ids.device
    b = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    steps, rows = _agreed(max_new_tokens, b, world_size)
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row's first token at position 0
    tokens, step_ids = [], input_ids
    ended = torch.zeros(b, dtype=torch.bool, device=device) if ended is None else ended
    every = stop_every or (STOP_EVERY if accelerator.is_accelerator(device) else 1)
    counts: list[torch.Tensor] = []  # this rank's ended rows after each forward not read yet, from forward `unread`
    unread = 0
    with generation_attention(model):
        for i in range(steps):
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            nxt = pick(out.logits[:, -1].float(), i)
            nxt = torch.where(ended, torch.full_like(nxt, pad_token_id), nxt)
            for stop in stop_ids:  # a few ids: compares on the device, no host list to copy over
                ended = ended | (nxt == stop)
            if i < max_new_tokens:  # beyond this rank's own budget: forwards for the other ranks' collectives only
                tokens.append(nxt)
            step_ids = nxt[:, None]
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=-1)
            positions = positions[:, -1:] + 1
            if stop_ids and i + 1 < steps:  # (the last forward is never read: nothing would be saved)
                unread = unread if counts else i
                counts.append(ended.sum())
                if len(counts) == every:
                    if (end := _first_all_ended(counts, rows, world_size)) is not None:
                        tokens = tokens[:unread + end + 1]
                        break
                    counts = []
        else:  # the forwards since the last read: where the per-token check would have stopped
            if counts and (end := _first_all_ended(counts, rows, world_size)) is not None:
                tokens = tokens[:unread + end + 1]
    return torch.stack(tokens, dim=1) if tokens else input_ids.new_zeros(b, 0)


def _agreed(max_new_tokens: int, rows: int, world_size: int) -> tuple[int, int]:
    """(the largest max_new_tokens, the rows) over the ranks: host numbers, on the host group."""
    if world_size == 1:
        return max_new_tokens, rows
    t = torch.tensor([max_new_tokens, rows], dtype=torch.int64)
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX, group=accelerator.host_group())
    dist.all_reduce(t[1:], group=accelerator.host_group())
    return int(t[0]), int(t[1])


def _first_all_ended(counts: list[torch.Tensor], rows: int, world_size: int) -> int | None:
    """The first of these forwards after which every row of every rank had ended (`rows` in all), or None: one
    collective and one host read for all of them. The simulated GPU reads 0: decoding goes on to the budget, as a
    model that never emits EOS does."""
    ended = torch.stack(counts)
    if world_size > 1:
        dist.all_reduce(ended)
    return next((j for j, n in enumerate(accelerator.to_host(ended).tolist()) if n == rows), None)
