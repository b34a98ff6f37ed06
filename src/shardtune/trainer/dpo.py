"""Direct Preference Optimization: sequence log-probs of a pair batch and the per-pair DPO losses and rewards.

Meanings follow TRL's `DPOTrainer` (1.16, checked against it in tests/unit/test_dpo_loss.py):
  delta  = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)      (sums over response tokens)
  sigmoid: -log sigmoid(beta * delta)
  hinge:   relu(1 - beta * delta)
  ipo:     (delta' - 1 / (2 beta))^2, delta' = the same difference with each log-ratio divided by its response's
           token count (TRL's length-normalised IPO)
  rewards: beta * (logp - ref) per response; accuracy: reward_chosen > reward_rejected.
`label_smoothing` eps (sigmoid only) is conservative DPO: the label is flipped with probability eps,
  loss = (1 - eps) * sigmoid(delta) + eps * sigmoid(-delta), which TRL up to 0.2x computed for `loss_type=sigmoid`
  (TRL 1.x dropped it from sigmoid; the test composes it from TRL's own loss on the pairs and on the swapped pairs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.data.formats import IGNORE

LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass
class PairOutput:
    losses: torch.Tensor  # [pairs] fp32, differentiable
    reward_chosen: torch.Tensor  # [pairs] detached
    reward_rejected: torch.Tensor  # [pairs] detached


def sequence_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's target tokens (logits upcast to at least fp32) and the target counts:
    [rows] each."""
    # Preference rows are never packed: one document then padding, which causal attention never lets the document
    # see, so each row is one causal span for the attention (model/attention.py), no device sync to find documents.
    whole_rows = ((input_ids.shape[1],),) * input_ids.shape[0]
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                   doc_lengths=whole_rows).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    target = labels[:, 1:]
    mask = target != IGNORE
    # cross_entropy per token = -log p(target); IGNORE positions give 0
    nll = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none")
    return -nll.sum(dim=1), mask.sum(dim=1)


def pair_losses(logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, *, beta: float, loss: str, label_smoothing: float = 0.0,
                len_chosen: torch.Tensor | None = None, len_rejected: torch.Tensor | None = None) -> PairOutput:
    """Per-pair DPO losses (no reduction: the caller divides by the global pair count)."""
    ratio_c = logp_chosen - ref_chosen
    ratio_r = logp_rejected - ref_rejected
    if loss == "sigmoid":
        z = beta * (ratio_c - ratio_r)
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss == "hinge":
        losses = torch.relu(1 - beta * (ratio_c - ratio_r))
    elif loss == "ipo":
        assert len_chosen is not None and len_rejected is not None, "ipo normalises by response length"
        delta = ratio_c / len_chosen.clamp(min=1) - ratio_r / len_rejected.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise AssertionError(f"unknown DPO loss {loss!r} (the schema checks dpo.loss)")
    return PairOutput(losses, beta * ratio_c.detach(), beta * ratio_r.detach())
