"""GRPO's step in the plan (train.objective=grpo, trainer/grpo.py): sampling, then training on the completions.

A GRPO step does two things with different shapes, and its peak is the larger:
  generate   before the step's first micro-step, each rank samples its prompts' groups in batches of one micro-batch
             (trainer/sampling.py): b x num_generations rows, the prompt left-padded to the batch's longest, then
             max_new_tokens forwards under no_grad on a KV cache (trainer/decode.py). Alive: the model states (no
             gradient yet: the last step's were set to None), the units gathered for a forward (under no_grad the
             engine frees each after its forward, the root too: the root, the unit and the one prefetched), the
             KV cache (per layer, K and V: rows x kv heads x tokens x head_dim, compute dtype), and either the
             prompt's forward at the MLP of a layer (prefill: gate, up and their product over every prompt token,
             the residual stream, rotary tables, the padding mask) or, at the last token, the cache at its longest
             while one layer's K or V is concatenated (the old one alive) and the sampler's [rows, vocab]
             temporaries. The previous round's rollouts are alive too (replaced after sampling).
  log-probs  with grpo.num_iterations > 1 (the sampling policy's) or grpo.beta > 0 (the reference: adapters off),
             one no_grad forward per micro-step over its rows with the whole logits (compute dtype, their fp32 copy
             divided by the temperature, log_softmax's output).
  training   one micro-step is an SFT-like step (plan/estimate.py's phases) over b x num_generations rows of
             prompt + completion tokens, one causal call each (never packed), the whole logits (no chunked loss);
             beside it every micro-step's rollout: token ids (int64), the completion mask, the old and reference
             log-probs per token (fp32, when kept), the advantages.
Worst case throughout: every prompt at its budget (data.seq_len: longer prompts keep their end) and every completion
max_new_tokens long (the simulated GPU reads zeros: it never draws a stop token either).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.plan.stats import ModelStats

# plan/estimate.py's Setup, StepFacts and ModelStates: estimate() calls this module, which therefore does not import
# it back (tests/unit/test_import_graph.py: no import circle)
Setup = StepFacts = ModelStates = Any

ROLLOUT_PHASES = ("generate", "logps")  # before the step's first micro-step (the objective's before_step)
PREFILL_H = 4  # residual-stream tensors alive at a layer's MLP in a no_grad forward (b·s·h each)
PREFILL_I = 3  # the MLP's b·s·i tensors alive at once: act(gate), up and their product


def is_grpo(stats: ModelStats) -> bool:
    return stats.recipe.train.objective == "grpo"


def training_setup(stats: ModelStats, s: Setup) -> Setup:
    """The training forward's shape: micro_batch x num_generations rows of prompt (data.seq_len, its budget) +
    max_new_tokens tokens, one causal call each (never packed)."""
    g = stats.recipe.grpo
    return dataclasses.replace(s, micro_batch=s.micro_batch * g.num_generations, seq_len=s.seq_len + g.max_new_tokens,
                               packing=False)


def rollout_bytes(stats: ModelStats, ts: Setup) -> int:
    """One micro-step's rollout on the device (trainer/grpo.py Rollout): ids [n, L] int64, the completion mask
    [n, L-1] fp32, the advantages [n] fp32, and the old / reference log-probs [n, L-1] fp32 when kept."""
    g = stats.recipe.grpo
    kept = (g.num_iterations > 1) + (g.beta > 0)
    n, length = ts.micro_batch, ts.seq_len
    return n * (8 * length + 4 * (length - 1) * (1 + kept) + 4)


def kv_bytes(stats: ModelStats, s: Setup, c: int, *, tokens: int, layers: int) -> int:
    """K and V of `layers` layers for `tokens` positions of every sampled row (transformers' DynamicCache)."""
    d = stats.dims
    return 2 * layers * s.micro_batch * stats.recipe.grpo.num_generations * tokens * d.num_kv_heads * d.head_dim * c


def generation_phase(stats: ModelStats, s: Setup, step: StepFacts, states: ModelStates,
                     rollouts: int) -> dict[str, int]:
    """The peak of sampling (module docstring): the larger of the prompt's forward and the last token's."""
    d, c, g = stats.dims, step.c, stats.recipe.grpo
    rows, prompt, new = s.micro_batch * g.num_generations, s.seq_len, g.max_new_tokens
    L = d.num_layers
    root, unit = gathered_while_sampling(s, step)
    ahead = unit if s.prefetch else 0
    # NF4: each matmul dequantizes its weight (whole, or a tile: plan/estimate.py nf4_matmul_bytes / nf4_tile_bytes)
    dequant = step.dequant if s.nf4 and s.lora else 0
    tokens = rows * prompt
    mlp_stage = tokens * (PREFILL_I * d.intermediate + PREFILL_H * d.hidden + 2 * d.head_dim) * c
    mask = rows * prompt * prompt  # transformers' boolean padding mask [rows, 1, s, s], kept for every layer
    # at the last layer the cache is whole and nothing is prefetched; at the one before, one layer short of whole
    prefill = mlp_stage + mask + max(kv_bytes(stats, s, c, tokens=prompt, layers=L) + root + unit,
                                     kv_bytes(stats, s, c, tokens=prompt, layers=L - 1) + root + unit + ahead)
    longest = prompt + new - 1  # the cache after the last forward (the last token is drawn, never fed back)
    old_layer = kv_bytes(stats, s, c, tokens=longest - 1, layers=1) // 2  # one K (or V) being concatenated
    # pick_tokens (trainer/sampling.py) on [rows, vocab]: the logits, their fp32 copy, / temperature, softmax and its
    # cumulative sum (fp32); top_p without top_k sorts them first (values and int64 order)
    sorts = g.top_p < 1 and not g.top_k
    pick = rows * d.vocab * (c + 16 + (12 if sorts else 0))
    # the padding mask grows by a column per token (int64, concatenated: two alive), the drawn tokens (int64) and
    # every token's uniform (fp32, on the device from the start)
    host_like = rows * (prompt + new) * 16 + rows * new * 12
    decode = kv_bytes(stats, s, c, tokens=longest, layers=L) + max(old_layer + root + unit + ahead, pick) + host_like
    peak = max(prefill, decode) + dequant
    gathered = root + unit + (ahead if decode >= prefill else 0)
    return {**states.static, "grads": 0, "gathered": gathered,
            "activations": peak - gathered + rollouts}


def gathered_while_sampling(s: Setup, step: StepFacts) -> tuple[int, int]:
    """(the root's gathered buffer, the largest unit's) while a no_grad forward runs: both freed after it."""
    return step.root_gathered, max(step.block_gathered, default=0)


def logps_phase(stats: ModelStats, ts: Setup, step: StepFacts, states: ModelStates, rollouts: int) -> dict[str, int]:
    """The no_grad forward that keeps old or reference log-probs (module docstring), with every rollout made."""
    d, c = stats.dims, step.c
    root, unit = gathered_while_sampling(ts, step)
    gathered = root + unit + (unit if ts.prefetch else 0)
    tokens = ts.micro_batch * ts.seq_len
    layer = tokens * (PREFILL_I * d.intermediate + PREFILL_H * d.hidden + 2 * d.head_dim) * c
    logits = tokens * d.vocab * (c + 4 + (4 if c != 4 else 0))  # the logits, the fp32 copy (not in fp32), / T
    return {**states.static, "grads": 0, "gathered": gathered, "activations": max(layer, logits) + rollouts}


def frozen_copy_bytes(stats: ModelStats, s: Setup, step: StepFacts) -> int:
    """Full fine-tuning with grpo.beta > 0: the reference is a frozen sharded copy of the starting weights
    (trainer/reference.py), held for the whole run: every parameter frozen, stored as a LoRA run's frozen base (the
    compute dtype on our engine, model.dtype on FSDP2). Its units are gathered one at a time for its no_grad forward,
    as the policy's are for theirs: no more than the log-probs phase already counts."""
    from shardtune.plan.stats import DTYPES

    if s.lora or stats.recipe.grpo.beta == 0:
        return 0
    dtype = s.compute if s.backend == "shardtune" else DTYPES[stats.recipe.model.dtype]
    units = stats.layouts(step.W, frozen_base=True, base_dtype=dtype, vocab_parallel=step.vp)
    return sum(f.shard_bytes() for u in units for f in u.flats)


def grpo_phases(stats: ModelStats, s: Setup, ts: Setup, step: StepFacts, states: ModelStates,
                phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The training phases (over `ts`, training_setup) with every rollout of the step beside them, the log-probs'
    forward when the recipe keeps any, and generation (over `s`, the recipe's prompts)."""
    g = stats.recipe.grpo
    rollouts = rollout_bytes(stats, ts) * ts.grad_accum
    out = {k: {**v, "activations": v.get("activations", 0) + rollouts} for k, v in phases.items() if k != "load"}
    if "load" in phases:
        out["load"] = phases["load"]
    if g.num_iterations > 1 or g.beta > 0:
        out["logps"] = logps_phase(stats, ts, step, states, rollouts)
    out["generate"] = generation_phase(stats, s, step, states, rollouts)
    # offloaded (engine.cpu_offload), the copy's shards live on the host (estimate's host_per_rank counts them)
    reference = frozen_copy_bytes(stats, ts, step) if not ts.offload or ts.device_is_cpu else 0
    for k in out:
        out[k]["params"] = out[k].get("params", 0) + reference
    return out


def grpo_line(stats: ModelStats, s: Setup, phases: dict[str, int], c: int) -> str:
    """How the plan counts a GRPO recipe (plan's report): the rows it trains on, the sampling phase and its cache."""
    g = stats.recipe.grpo
    rows = s.micro_batch * g.num_generations
    cache = kv_bytes(stats, s, c, tokens=s.seq_len + g.max_new_tokens - 1, layers=stats.dims.num_layers)
    kept = [name for name, on in (("old", g.num_iterations > 1), ("reference", g.beta > 0)) if on]
    logps = f"; {' and '.join(kept)} log-probs kept (+1 no-grad forward each)" if kept else ""
    return (f"GRPO: micro-batch {s.micro_batch} prompt(s) x {g.num_generations} completions = {rows} rows of "
            f"{s.seq_len} + {g.max_new_tokens} tokens per forward; sampling peaks at "
            f"{phases['generate'] / 2**30:.2f} GiB (KV cache {cache / 2**30:.2f} GiB){logps}")
