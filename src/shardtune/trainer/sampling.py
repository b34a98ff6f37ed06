"""GRPO's completions from the sharded policy: batched, with a KV cache, ranks in lockstep (trainer/decode.py's loop,
every forward gathers parameters with collectives), and seeded so that a prompt draws the same completions whatever
the world size or micro-batching.

Seeding. A token is drawn by inverse CDF from ONE uniform that depends only on (seed, step, prompt id, generation
index, token position): generation g of a prompt has its own counter-based stream (numpy's Philox keyed by a
SeedSequence of the first four), token t takes its t-th number. No rank, place in a batch or other row enters it.

Logits. The other half is that a row's logits are the same bits wherever the row runs. They are not across batch
shapes: on CPU fp32 (tiny-llama, measured) a row's logits move by ~4e-7 with the number of rows in the forward (the
GEMM computes tail rows with another kernel: rows 5, 6, 9 differ, 4, 8, 16 not) and with its left padding (the
attention reduces over more keys); GPU GEMMs choose kernels by shape as well. The same batch, though, gives the same
bits: a batch's shapes and values depend only on its prompts (a prompt's generations together, left-padded to the
batch's longest prompt). So a rank generates its prompts in consecutive batches of `prompts_per_batch`, and a rank
whose share is whole batches draws bit for bit what one rank draws. Across other splits a token can differ only
when its uniform falls within an ulp of a boundary of the CDF.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from shardtune import accelerator
from shardtune.trainer.decode import decode_tokens
from shardtune.trainer.runtime import host_max


@torch.no_grad()
def sample_completions(model: nn.Module, prompt_ids: list[list[int]], *, keys: Sequence[tuple[int, int, int]],
                       num_generations: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int | None = None, stop_ids: Sequence[int], pad_id: int, world_size: int = 1,
                       device: torch.device | str, prompts_per_batch: int | None = None,
                       logprobs: bool = False) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
    """`num_generations` completions of each prompt, a prompt's adjacent: len(prompt_ids) x num_generations lists of
    token ids, each ending at its first stop id (kept: the policy learns to emit it) or at `max_new_tokens`.
    `keys`: (seed, step, prompt id) per prompt, the draws' only randomness. `prompts_per_batch`: prompts per forward
    batch (None: all). `device`: the model's (the runtime's; a sharded model has no weight to ask it of).
    `logprobs`: also return, per token, its log-probability under softmax(logits / temperature), before
    top-k/top-p, as fp32 host floats."""
    _check(prompt_ids, keys, num_generations=num_generations, max_new_tokens=max_new_tokens, temperature=temperature,
           top_p=top_p, top_k=top_k, prompts_per_batch=prompts_per_batch)
    device = torch.device(device)
    size = prompts_per_batch or max(len(prompt_ids), 1)
    starts = range(0, len(prompt_ids), size)
    # Ranks in lockstep: every rank runs the most batches of any rank (a host number, agreed on the host group)
    rounds = len(starts) if world_size == 1 else int(host_max(len(starts)))
    completions, scores = [], []
    for r in range(rounds):
        if r >= len(starts):  # forwards for the other ranks' collectives only
            _idle_batch(model, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                        world_size=world_size, device=device)
            continue
        batch = slice(starts[r], starts[r] + size)
        tokens, chosen = _sample_batch(model, prompt_ids[batch], keys[batch], num_generations=num_generations,
                                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, stop_ids=stop_ids, pad_id=pad_id, world_size=world_size,
                                       device=device, logprobs=logprobs)
        for i, row in enumerate(tokens.tolist()):
            n = _length(row, stop_ids)
            completions.append(row[:n])
            if logprobs:
                scores.append(chosen[i, :n].tolist())
    return (completions, scores) if logprobs else completions


def pick_tokens(logits: torch.Tensor, u: torch.Tensor, *, temperature: float, top_k: int | None = None,
                top_p: float = 1.0) -> torch.Tensor:
    """[b, vocab] fp32 logits and [b] uniforms in [0, 1) -> [b] token ids, by inverse CDF: of softmax(logits /
    temperature) kept to its top_k largest, then to the fewest of those whose mass reaches top_p (transformers'
    temperature, top-k and top-p warpers, in generate's order), the first token whose cumulative mass exceeds u times
    the kept mass. Tokens in descending order when filtered, in vocabulary order otherwise (any fixed order is an
    inverse CDF: no sort of the vocabulary). temperature 0: argmax, greedy. Row by row: no row reads another."""
    if temperature == 0:
        return logits.argmax(-1)
    x = logits / temperature
    order = None
    if top_k and top_k < x.shape[-1]:
        x, order = x.topk(top_k, dim=-1)  # largest first; ties at the k-th value: k tokens, not all of them
    elif top_p < 1:
        x, order = x.sort(dim=-1, descending=True, stable=True)
    p = torch.softmax(x, dim=-1)
    if top_p < 1:
        p = p * ((p.cumsum(-1) - p) < top_p)  # a token stays while the mass before it is short of top_p
    cdf = p.cumsum(-1)
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    # u x mass rounded up to the whole mass finds no token above it: the last kept one is the right pick
    last = p.shape[-1] - 1 - (p.flip(-1) > 0).to(torch.int32).argmax(-1)
    idx = torch.minimum(idx, last)
    return idx if order is None else order.gather(-1, idx[:, None]).squeeze(-1)


def uniforms(seed: int, step: int, prompt_id: int, generation: int, num_tokens: int) -> np.ndarray:
    """The uniforms in [0, 1) of one completion's tokens ([num_tokens] fp32, 24-bit): token t's is the t-th number
    of a Philox stream keyed by the four integers alone, whatever num_tokens is."""
    key = np.random.SeedSequence([seed, step, prompt_id, generation])
    return np.random.Generator(np.random.Philox(key)).random(num_tokens, dtype=np.float32)


def _sample_batch(model: nn.Module, prompts: list[list[int]], keys: Sequence[tuple[int, int, int]], *,
                  num_generations: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int | None,
                  stop_ids: Sequence[int], pad_id: int, world_size: int, device: torch.device,
                  logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward batch: each prompt's generations, left-padded to the longest prompt -> ([rows, <= max_new_tokens]
    host token ids padded after a stop, the picked tokens' log-probabilities on the host or None)."""
    rows = [p for p in prompts for _ in range(num_generations)]
    length = max(len(p) for p in prompts)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, length - len(p):] = 1
    u = torch.from_numpy(np.stack([uniforms(*key, g, max(max_new_tokens, 1))
                                   for key in keys for g in range(num_generations)]))
    # one copy of every uniform of the batch to the device, then a column per token: no host work in the loop
    ids, mask, u = (accelerator.to_device(t, device) for t in (ids, mask, u))
    chosen = []

    def pick(logits: torch.Tensor, i: int) -> torch.Tensor:
        nxt = pick_tokens(logits, u[:, min(i, u.shape[1] - 1)], temperature=temperature, top_k=top_k, top_p=top_p)
        if logprobs and i < max_new_tokens:
            scaled = logits / temperature if temperature > 0 else logits
            chosen.append(torch.log_softmax(scaled, dim=-1).gather(-1, nxt[:, None]).squeeze(-1))
        return nxt

    new = decode_tokens(model, ids, mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id, stop_ids=stop_ids,
                        world_size=world_size, pick=pick)
    # the batch's one read of the device: its completions (a sync point on a GPU)
    tokens = accelerator.to_host(new)
    scores = accelerator.to_host(torch.stack(chosen, dim=1)) if chosen else None
    return tokens, scores


def _idle_batch(model: nn.Module, *, max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, world_size: int,
                device: torch.device) -> None:
    """A rank with no batch left in this round: one ended row, decoded as long as the others decode."""
    ids = accelerator.to_device(torch.full((1, 1), pad_id, dtype=torch.long), device)
    decode_tokens(model, ids, None, max_new_tokens=max_new_tokens, pad_token_id=pad_id, stop_ids=stop_ids,
                  world_size=world_size, pick=lambda logits, _: logits.argmax(-1),
                  ended=torch.ones(1, dtype=torch.bool, device=device))


def _length(row: list[int], stop_ids: Sequence[int]) -> int:
    """Tokens up to and including the first stop id (all when none)."""
    stops = set(stop_ids)
    return next((i + 1 for i, t in enumerate(row) if t in stops), len(row))


def _check(prompt_ids: list[list[int]], keys: Sequence[tuple[int, int, int]], *, num_generations: int,
           max_new_tokens: int, temperature: float, top_p: float, top_k: int | None,
           prompts_per_batch: int | None) -> None:
    if len(keys) != len(prompt_ids):
        raise ValueError(f"sampling: {len(keys)} keys for {len(prompt_ids)} prompts (one (seed, step, prompt id) each)")
    if any(len(k) != 3 or min(k) < 0 for k in keys):
        raise ValueError("sampling: a key is (seed, step, prompt id), three non-negative integers")
    if any(not p for p in prompt_ids):
        raise ValueError(f"sampling: prompt {next(i for i, p in enumerate(prompt_ids) if not p)} has no tokens")
    for name, value, ok in (("num_generations", num_generations, num_generations >= 1),
                            ("max_new_tokens", max_new_tokens, max_new_tokens >= 0),
                            ("temperature", temperature, temperature >= 0),
                            ("top_p", top_p, 0 < top_p <= 1),
                            ("top_k", top_k, top_k is None or top_k >= 0),
                            ("prompts_per_batch", prompts_per_batch,
                             prompts_per_batch is None or prompts_per_batch >= 1)):
        if not ok:
            raise ValueError(f"sampling: {name}={value} is out of range")
