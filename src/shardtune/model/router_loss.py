"""The routers' load-balancing loss of a mixture of experts (`train.router_aux_loss_coef`), exact under data
parallelism.

transformers' `load_balancing_loss_func` is Switch's E·Σₑ fₑ·Pₑ over the whole micro-batch (fₑ: the share of
routed slots that went to expert e, Pₑ: the mean router probability of e): a product of two means over the batch,
which no split of the batch over ranks and micro-steps reproduces. We take the same loss per row (a packed row is
never split; DeepSeek-V3's sequence-wise form): each token adds E·Σₑ fₑ(row)·pₑ(token), f counted over its own row
(no gradient, as in Switch), and the sum over tokens, averaged over the MoE layers, is divided by the step's global
target-token count like the main loss. So the gradient summed over ranks and micro-steps is the same at every
world size. A balanced router gives ~1 per token; the cost is one softmax of the (tokens, experts) logits per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """transformers 5's top-k routers, beside an experts module in each MoE block: `forward` returns (logits, scores,
    top-k indices) and has `top_k`. Found by module attributes, which survive sharding (the weights do not)."""
    def experts(m: nn.Module) -> bool:
        return hasattr(m, "is_transposed") and hasattr(m, "num_experts")

    blocks = [m for m in model.modules() if any(experts(c) for c in m.children())]
    return [c for b in blocks for c in b.children() if hasattr(c, "top_k") and not experts(c)]


class RouterBalance:
    """Records each router's output during a grad-enabled forward; `loss` turns them into the balance loss."""

    def __init__(self, model: nn.Module) -> None:
        # per router, in call order: one entry per forward, or one per chunk of the sequence (model/tiled_mlp.py
        # cuts its MLP's tokens in order, so a router's chunks concatenate into its whole output)
        self._seen: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for r in routers(model):
            r.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args, out) -> None:
        if torch.is_grad_enabled():  # training forwards only (eval and generate keep nothing)
            logits, _, indices = out
            self._seen.setdefault(module, []).append((logits, indices))

    def start(self) -> None:
        self._seen.clear()  # also drops what an activation-checkpoint recompute recorded in the last backward

    def recorded(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each router's (logits, top-k indices) over this forward's tokens, its chunks joined."""
        return [tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*calls, strict=True))
                for calls in self._seen.values()]

    def loss(self, rows: int, norm: int) -> torch.Tensor:
        """Σ over this forward's tokens of E·Σₑ fₑ(row)·pₑ(token), averaged over layers, / norm."""
        assert self._seen, "no router ran in this forward"
        total, layers = None, len(self._seen)
        for logits, indices in self.recorded():
            e, k = logits.shape[-1], indices.shape[-1]
            probs = F.softmax(logits.float(), dim=-1).view(rows, -1, e)  # (rows, seq, E)
            with torch.no_grad():
                counts = F.one_hot(indices.view(rows, -1, k), e).sum(dim=(1, 2)).float()  # (rows, E)
                share = counts / counts.sum(dim=-1, keepdim=True)  # f(row)
            term = e * (probs * share[:, None, :]).sum()
            total = term if total is None else total + term
        self._seen.clear()
        return total / layers / norm
