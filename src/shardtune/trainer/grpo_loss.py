"""GRPO's group advantages and clipped policy loss: TRL 1.16 `GRPOTrainer`'s (`_generate_and_score_completions` and
`_compute_loss`, importance_sampling_level "token"; checked against TRL's own code in tests/unit/test_grpo_loss.py).

Advantages (rewards [N], a prompt's `num_generations` completions adjacent):
  A = r - mean(r over its group), then divided by std + 1e-4 (std with Bessel's correction, as TRL's `nanstd`):
  scale_rewards "group": the group's std; "batch": the std of all N rewards (TRL gathers them over the processes,
  so pass the global batch's rewards); "none": not divided.

Per completion token t of sequence i (m = the completion mask):
  ratio = exp(logps - old_logps)               (old_logps None: logps.detach(), i.e. one pass per generation)
  loss  = -min(ratio A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) A) + beta kl
  kl    = exp(ref - logps) - (ref - logps) - 1 (Schulman's k3 estimator, TRL's), only when beta != 0;
          x ratio when kl_bias_correction (TRL's use_bias_correction_kl, default True: the unbiased reverse-KL
          gradient of DeepSeek-V3.2; ratio is differentiable, so it changes the gradient even in one pass).

Reduction. The engine's convention (trainer/objective.py): a micro-batch's loss is divided by the GLOBAL batch's
normaliser, so the sum over ranks and micro-steps is the step's loss at any world size x grad_accum. TRL divides by
local counts and lets grad_accum and DDP's gradient mean divide by grad_accum x processes; with equal micro-batches
that is the same thing, and the arguments below make it exact for any split. With b = this micro-batch's sequences:
  grpo     sum_i [sum_t m loss / max(1, sum_t m)] / num_sequences
           GLOBAL: num_sequences = completions in the whole step (all ranks, all micro-batches). TRL: the mean over
           its b sequences / grad_accum, averaged over processes.
  dr_grpo  sum m loss / (num_sequences * max_completion_length)
           GLOBAL: num_sequences as for grpo. TRL: b * max_completion_length / grad_accum, averaged over processes.
  dapo     sum m loss / max(1, num_items_in_batch)                         (TRL's default loss_type)
           GLOBAL: num_items_in_batch = the masked completion tokens of the whole step. TRL gathers the same count
           over the generation batch and processes and rescales it to one accumulation window (equal to it with
           steps_per_generation = grad_accum, TRL's default).
  bnpo     [sum m loss / max(1, sum m)] * b / num_sequences
           LOCAL by definition: the token mean of THIS micro-batch (TRL's normaliser), weighted by its share of the
           step's sequences (TRL's 1 / (grad_accum x processes) for equal micro-batches). 2 ranks do not sum to 1
           rank's loss unless every micro-batch holds the same number of tokens; bnpo is exempt from the
           world-size exactness contract.
To get TRL's loss for one process and grad_accum 1: num_sequences = b, num_items_in_batch = mask.sum().

Stats are sums (0-d fp64, detached), so the trainer all-reduces them once per step with the loss, like the other
objectives; `stats_means` turns the global sums into what TRL logs (its `global_masked_mean`, exact over ranks).
TRL's per-sequence extremes (clip_ratio/low_min, high_max) need a min/max reduction and are not kept.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: added to the std so a zero-variance group gives advantages 0, not NaN


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Std with Bessel's correction, computed as TRL's `nanstd` does (mean of squares x n / (n - 1)), so the
    advantages agree to the last bits; the rewards are finite (trainer/rewards.py refuses non-numbers)."""
    n = x.shape[dim]
    mean = x.mean(dim=dim, keepdim=True)
    return ((x - mean) ** 2).mean(dim=dim).mul(n / (n - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, num_generations: int, *, scale_rewards: str) -> torch.Tensor:
    """[N] advantages of [N] rewards, N = prompts x num_generations, a prompt's generations adjacent."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards: must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    assert rewards.dim() == 1 and num_generations > 0 and rewards.numel() % num_generations == 0, \
        (tuple(rewards.shape), num_generations)
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "none":
        return advantages
    if scale_rewards == "group":
        std = (_std(grouped, 1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))  # one generation: no spread (TRL: eval with num_generations_eval=1)
    else:
        std = _std(rewards, 0).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return advantages / (std + STD_EPS)


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str, epsilon_low: float,
                epsilon_high: float, beta: float, max_completion_length: int,
                num_items_in_batch: int | torch.Tensor, num_sequences: int | torch.Tensor,
                kl_bias_correction: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's GRPO loss (module docstring: which normaliser is global) and its
    summed stats. logps/old_logps/ref_logps/mask: [b, t] per completion token; advantages: [b] (or [b, t])."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo.loss_type: must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"grpo.beta={beta}: the KL term needs the reference log-probabilities (ref_logps)")
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_logps is None:  # one optimisation pass: the policy that sampled is this one
        old_logps = logps.detach()
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_sequences
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (num_sequences * max_completion_length)
    elif loss_type == "dapo":
        loss = masked.sum() / torch.as_tensor(num_items_in_batch, dtype=logps.dtype, device=logps.device).clamp(min=1.0)
    else:  # bnpo: this micro-batch's own token count (local by definition)
        loss = masked.sum() / mask.sum().clamp(min=1.0) * (logps.shape[0] / num_sequences)

    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype) * mask
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype) * mask
        stats = {"num_tokens": mask.sum(), "clip_low_tokens": low.sum(), "clip_high_tokens": high.sum(),
                 # a token clips low only with A < 0 and high only with A > 0: the region count is the sum
                 "clip_region_tokens": (low + high).sum()}
        if beta != 0.0:
            stats["kl_sum"] = (kl.detach() * mask).sum()
    return loss, {k: v.double() for k, v in stats.items()}


def stats_means(sums: Mapping[str, float | torch.Tensor]) -> dict[str, float | torch.Tensor]:
    """TRL's logged figures from `policy_loss` stats summed over micro-batches and ranks: kl (when beta != 0, the
    corrected term under kl_bias_correction as TRL logs it) and
    clip_ratio/{low,high,region}_mean, each a mean over the masked completion tokens."""
    n = sums["num_tokens"]
    n = max(n, 1.0) if isinstance(n, float | int) else n.clamp(min=1.0)
    out = {f"clip_ratio/{k}_mean": sums[f"clip_{k}_tokens"] / n for k in ("low", "high", "region")}
    if "kl_sum" in sums:
        out = {"kl": sums["kl_sum"] / n, **out}
    return out
