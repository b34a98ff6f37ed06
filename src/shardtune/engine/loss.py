"""The next-token loss without b*s*V logits: the head projection and the cross-entropy run over chunks of tokens.

Today's path (`chunk_tokens=0`) computes `lm_head(hidden)` for every token (b*s*V in the compute dtype), upcasts it
to fp32 (4*b*s*V) and keeps both for backward, then cross-entropy's gradient is another 4*b*s*V: at a 128k vocabulary
these are the largest tensors of the step. Chunking *after* the projection frees nothing (torchtune #1390): the
projection's output already exists. So the chunks are taken before it:

  forward  for each chunk of C tokens: logits_c = h_c @ W^T (compute dtype), upcast to fp32, loss_c = lse - x_target;
           when a gradient is wanted, the gradient is formed right there (softmax - onehot, cast back to the compute
           dtype, as the fp32 upcast's backward does) and contracted at once: grad_h[c] = g_c @ W, grad_W += g_c^T h_c.
  backward scales the stored grad_h / grad_W by the incoming scalar: no recompute of the projection.

Peak: one chunk's fp32 logits, turned into the gradient in place (C*V*4; in bf16 also the bf16 logits, then the bf16
gradient: C*V*2), instead of 3 fp32 b*s*V tensors, plus grad_h (b*s*H, the size of one activation). grad_W (the
head's gradient, V*H) exists only when the head trains; it would exist in backward anyway. Numerics: the same
operations as the unchunked path per token, in fp32 for the softmax; sums are in a different order (chunk by chunk), so
fp32 runs agree to ~1e-7 relative, not bit for bit.

Where it hooks in: the trainer and eval call `token_loss_sum` (trainer/evaluate.py re-exports it). The model is called as a
whole (the engines' root hooks) with `logits_to_keep` selecting nothing, and the loss is computed when the head is
called, inside the root's forward, while its weight is gathered (plan/estimate.py `loss_bytes` models the bytes).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.data.formats import IGNORE
from shardtune.engine.layout import supports_chunked_loss  # also what vocab_parallel shards (layout.py)
from shardtune.model import context_parallel


def token_loss_sum(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                   *, chunk_tokens: int = 0, doc_lengths: tuple | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens, in fp32. `chunk_tokens=0`: full logits in one piece.
    `doc_lengths`: each row's documents (model/attention.py), so the attention finds them without a device sync."""
    if context_parallel.size() > 1:
        return _context_parallel_loss(model, input_ids, labels, position_ids, chunk_tokens, doc_lengths)
    extra = {} if doc_lengths is None else {"doc_lengths": doc_lengths}
    if chunk_tokens <= 0 or not supports_chunked_loss(model):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=IGNORE, reduction="sum")
    return _fused_loss(model, input_ids, position_ids, _targets(labels).flatten(), chunk_tokens, extra)


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next token: the labels shifted by one, the last position of each row without one. Shifting
    the targets, not the hidden states, avoids a copy of b*s*H."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def _context_parallel_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                           position_ids: torch.Tensor, chunk_tokens: int, doc_lengths: tuple | None) -> torch.Tensor:
    """engine.context_parallel (model/context_parallel.py): the loss summed over this rank's tokens of each row, whose
    targets are shifted over the whole row first (a rank's last token's target is the next rank's first token)."""
    b, s = input_ids.shape
    a, z = context_parallel.bounds(s)
    ids, pos, targets = (t[:, a:z].contiguous() for t in (input_ids, position_ids.expand(b, -1), _targets(labels)))
    context_parallel.set_rows(a, z, doc_lengths or [[s]] * b)
    if chunk_tokens > 0 and supports_chunked_loss(model):
        return _fused_loss(model, ids, pos, targets.flatten(), chunk_tokens, {})
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def _fused_loss(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, extra: dict[str, Any]) -> torch.Tensor:
    """One call of the whole model (the root module's hooks, either backend, must see it), with `logits_to_keep`
    selecting no position, so the head projects nothing. The loss is computed when the head is called, inside the
    root's forward: the head's weight is gathered then, also under no_grad, where our engine frees every unit,
    the root included, as soon as its forward returns. The decoder's last hidden state (after the final norm) is
    taken from its output on the way."""
    hidden: list[torch.Tensor] = []
    loss: list[torch.Tensor] = []

    def grab(_module: nn.Module, _args: Any, output: Any) -> None:
        hidden.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    def project(head: nn.Module, _args: Any) -> None:
        assert len(hidden) == 1, "the decoder ran once before the head"
        table = getattr(head, "_shardtune_vocab", None)  # engine.vocab_parallel: the head's rows stay sharded
        if table is not None:
            loss.append(table.cross_entropy(hidden[0].flatten(0, 1), targets, chunk_tokens))
            return
        loss.append(linear_cross_entropy(hidden[0].flatten(0, 1), head.weight, targets, chunk_tokens=chunk_tokens))

    handles = [model.get_decoder().register_forward_hook(grab),
               model.get_output_embeddings().register_forward_pre_hook(project)]
    try:
        none = torch.empty(0, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=none, **extra)
    finally:
        for h in handles:
            h.remove()
    assert len(loss) == 1, "the head ran once per forward"
    return loss[0]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int) -> torch.Tensor:
    """sum_t CE(hidden[t] @ weight^T, targets[t]) over targets != IGNORE, chunk by chunk. hidden: (N, H); weight:
    (V, H); targets: (N,). Returns an fp32 scalar."""
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # hidden may be fp32 where the head computes in bf16 (autocast-free mixed precision casts inside modules):
        # the head's matmul runs in the weight's dtype, as nn.Linear would.
        h_all = hidden.to(weight.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(h_all) if want_h else None
        # V*H fp32, only when the head trains: summed over chunks in fp32 (a bf16 sum drops small contributions)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for start in range(0, h_all.shape[0], chunk_tokens):
            h = h_all[start:start + chunk_tokens]
            t = targets[start:start + chunk_tokens]
            logits = (h @ weight.t()).float()  # C*V: the only logits alive
            del_rows = t == IGNORE
            safe_t = t.masked_fill(del_rows, 0)
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            lse = softmax_lse_(logits)  # the logits are the softmax from here
            total += (lse - picked).masked_fill(del_rows, 0.0).sum()
            if not (want_h or want_w):
                continue
            # d loss / d logits = softmax - onehot, zero for ignored tokens; in place over the fp32 logits
            g = logits
            g.scatter_add_(1, safe_t[:, None], torch.full_like(picked[:, None], -1.0))
            g.masked_fill_(del_rows[:, None], 0.0)
            g = g.to(weight.dtype)  # the fp32 upcast's backward: the head's matmuls run in the compute dtype
            if want_h:
                torch.mm(g, weight, out=grad_h[start:start + chunk_tokens])
            if want_w:
                add_outer_fp32(grad_w, g, h)
            del logits, g
        ctx.save_for_backward(grad_h if want_h else None, grad_w if want_w else None)
        ctx.hidden_dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        # Scaled in place: a copy of grad_W would be one more V*H. (A second backward through this graph would
        # need retain_graph, and would scale twice: the trainer never does that.)
        return (*scale_saved_grads(*ctx.saved_tensors, grad_out, ctx.hidden_dtype), None, None)


def softmax_lse_(logits: torch.Tensor) -> torch.Tensor:
    """In place over fp32 `logits` (C x V): they become their softmax over V; returns each row's log-sum-exp, as
    torch.logsumexp computes it (max-shifted). Not torch.logsumexp: inside the op it allocates a C x V temporary
    (exp(x - max)) that no tracker sees, 0.49 GiB per 1,024-token chunk at a 128k vocabulary: on an H200 the
    peak read ~0.3 GiB over the plan where this loss peaks (bench/RESULTS.md stop 54)."""
    top = logits.amax(dim=-1, keepdim=True)
    sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
    logits.div_(sums)
    return (sums.log_() + top).squeeze(1)


ROW_BLOCK = 4096  # rows of the head's gradient per bf16 product: bounds its transient to ROW_BLOCK·H·2 bytes


def add_outer_fp32(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc (R, H, fp32) += g^T @ h (g: C x R, h: C x H, compute dtype). The product runs in the compute dtype (a
    tensor-core matmul, fp32 accumulation inside, rounded once) by blocks of rows, and is summed into the fp32
    accumulator: a chunk's rounding never compounds over the chunks, as `nn.Linear`'s single backward matmul."""
    for r in range(0, acc.shape[0], ROW_BLOCK):
        acc[r:r + ROW_BLOCK].add_(g[:, r:r + ROW_BLOCK].t() @ h)


def scale_saved_grads(grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, grad_out: torch.Tensor,
                      hidden_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients a fused loss formed in forward (for a loss of 1), scaled in place by the incoming scalar; grad_h
    back in the hidden states' dtype. Also engine/vocab.py's. The scale stays fp32: the trainer's 1 / (target count)
    rounded to bf16 is off by up to 0.4 %, the same for every gradient of the step. A bf16 grad_h is multiplied in fp32
    and rounded once, by blocks of rows (a whole fp32 copy would be one more b·s·H·4)."""
    if grad_h is not None:
        scale = grad_out.to(torch.float32)
        if grad_h.dtype == torch.float32 or hidden_dtype == torch.float32:
            grad_h = grad_h.to(torch.float32).mul_(scale).to(hidden_dtype)
        else:
            for r in range(0, grad_h.shape[0], ROW_BLOCK):
                block = grad_h[r:r + ROW_BLOCK]
                block.copy_(block.float().mul_(scale))
            grad_h = grad_h.to(hidden_dtype)
    if grad_w is not None:
        grad_w = grad_w.mul_(grad_out.to(grad_w.dtype))
    return grad_h, grad_w
