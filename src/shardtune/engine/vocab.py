"""Vocabulary parallelism (`engine.vocab_parallel`): the embedding and the head are sharded by vocabulary rows over
the shard group and never gathered.

Each table is a flat buffer of its own (layout.py `vocab_flat_groups`), padded to whole rows per rank: rank r of W
owns rows [r·R, (r+1)·R), R = ceil(V / W); the last ranks' padding rows are zero and never reach the softmax. So
the checkpoint keeps one entry per original parameter (state_dict.py describes a rank's rows as a 1-D chunk), and
loading and the seeded init fill rows like any flat. A tied table (gemma, qwen3) is one buffer serving both.

Under FSDP every rank has its own batch, so the rows a rank needs for its tokens sit on every rank. Hence:
  embedding  all-gather the ids of the shard group (b·s int64 each), look up the local rows for all of them (zero
             where another rank owns the id), reduce-scatter the W·b·s·H result: each rank gets its tokens'
             vectors. Exact: every element is one rank's value plus zeros. Backward (trainable table only):
             all-gather the vectors' gradients and add them into the local rows.
  head+loss  all-gather the final hidden states (W·b·s·H) and targets; per chunk of tokens, local logits
             (C x R, fp32), then one all-gather of two numbers per token (the local rows' log-sum-exp, the
             target's logit where it is local) gives the exact log-sum-exp; the gradient is formed at once
             (softmax - onehot, as engine/loss.py does), its contraction with the local rows is reduce-scattered back to
             the tokens' ranks, and the table's gradient stays local (no reduce-scatter).
  logits     (eval without chunking, DPO, generation) the same gather, local logits for all tokens, and one
             all-to-all hands each rank the full V columns of its own tokens; backward reverses it.
Traffic per micro-step (bf16, W ranks): about 4·(W-1)·b·s·H·2 bytes for embedding + head, against 2·(W-1)/W·V·H·2
for gathering the two tables: 70B at s=1024, W=2: 64 MiB instead of 2 GiB.
Token counts may differ per rank (eval, generation): each call agrees on the largest count on the host group and
pads to it.
Hybrid sharding: the tables are sharded within a shard group; a trainable table's gradient is summed over the
replicas at the end of a synced backward (a ReplicatedParams over the replicate group: the same pending scheme).
cpu_offload on an accelerator: the rows live on the host (pinned); their unit copies them to the device once per
unshard, and each use's gradient goes back D2H on the copy stream into the table's pinned landing buffers, added on
the host when the gradients are next read (engine/reduce.py `copy_to_host`): the host never waits in the backward,
except for a tied table, whose embedding copy first adds the head's, issued a whole backward earlier.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from shardtune import accelerator
from shardtune.data.formats import IGNORE
from shardtune.engine.collectives import CommCounter, all_gather_into, all_to_all_into, reduce_scatter_into
from shardtune.engine.loss import add_outer_fp32, softmax_lse_

# shard group -> its last embedding call's count, when every rank had it. Weak keys: a strong one would keep the
# process group (and gloo's threads) alive past destroy_process_group, into interpreter teardown.
_UNIFORM_TOKENS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


class VocabTable:
    """One vocabulary table's local rows (a FlatParam built with whole rows per rank) and its collectives."""

    def __init__(self, flat: Any, *, num_rows: int, hidden: int, group: ProcessGroup, counter: CommCounter,
                 device: torch.device, padding_idx: int | None, reduce_dtype: torch.dtype, reducer: Any = None,
                 copy_stream: Any = None) -> None:
        self.flat = flat
        self.num_rows = num_rows  # V, the real vocabulary
        self.hidden = hidden
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counter = counter
        self.device = device
        self.rows_per_rank = flat.shard_numel // hidden  # R
        assert self.rows_per_rank * hidden == flat.shard_numel and self.rows_per_rank * self.world >= num_rows
        self.lo = self.rank * self.rows_per_rank
        self.num_local = max(0, min(num_rows - self.lo, self.rows_per_rank))  # real rows here (padding excluded)
        self.padding_idx = padding_idx  # nn.Embedding's: that row gets no gradient
        self.reduce_dtype = reduce_dtype  # engine.reduce_dtype: the hidden states' gradients are summed over ranks in it
        # cpu_offload on an accelerator: the rows' gradient goes to the host through the units' reducer (its D2H
        # copies, added on the host before the optimizer reads gradients), issued on the copy stream
        self.reducer = reducer
        self.copy_stream = copy_stream
        self.replicas: Any = None  # hybrid_shard: the tables' ReplicatedParams, which sum the host gradient

    def weight(self) -> torch.Tensor:
        """The local real rows (num_local x H) in the compute dtype on the compute device. Trainable: a cast of the
        fp32 master segment, so autograd sends the rows' gradient into the segment's .grad."""
        flat = self.flat
        n = self.num_local * self.hidden
        src = flat.segments[0][3] if flat.segments else flat.shard[:n]
        # cpu_offload: the rows live on the host. Their unit copied them to the device on its copy stream when it
        # was unsharded (flat.staged; the compute stream waited for that copy), once for every use until it is
        # resharded. A use outside (none in training) copies here, on the current stream. No copy when on the device.
        dev = src
        if flat.on_host:
            staged = (flat.staged if flat.staged is not None else flat.shard_on_device(flat.dtype))[:n]
            grad = src.requires_grad and torch.is_grad_enabled()
            dev = _RowsToDevice.apply(src, staged, self) if grad else staged
        return dev.view(self.num_local, self.hidden).to(flat.compute_dtype)

    def grad_to_host(self, grad: torch.Tensor, *, reduced: bool = False) -> None:
        """cpu_offload: this use's gradient of the local rows (on the device, fp32, num_local·H) to the host
        segment's gradient, without blocking: a D2H copy on the copy stream into a pinned buffer, added on the host
        once the copy's event has passed (reduce.py `copy_to_host`), before clipping and the optimizer read it.
        Hybrid: a use's copy is summed into the replicas' host bucket; `reduced`, the bucket's slice summed over
        the replicas (engine/replicated.py `land`), becomes the gradient."""
        (_, _, _, segment), = self.flat.segments
        add = (functools.partial(self.replicas.add, segment) if self.replicas is not None and not reduced
               else functools.partial(_add_grad, segment))
        self.reducer.copy_to_host(self.flat, grad, stream=self.copy_stream, add=add)

    # -- token exchange -----------------------------------------------------------------------------------------------
    def max_tokens(self, n: int, *, first: bool = False) -> int:
        """The largest token count of this call over all ranks (host metadata, agreed on the gloo host group).
        One round trip per forward: the embedding's call (`first`) also learns whether every rank has the same
        count; then a later use with that same count (the head over the same tokens, on every rank alike) needs no
        agreement."""
        if not first and n == _UNIFORM_TOKENS.get(self.group):
            return n
        t = torch.tensor([n, -n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=accelerator.host_group())
        largest, smallest = int(t[0]), -int(t[1])
        if first:  # shared by the group's tables: the head of an untied model is a table of its own
            _UNIFORM_TOKENS[self.group] = n if largest == smallest else None
        return largest

    def gather(self, x: torch.Tensor, n_max: int, fill: float | int = 0) -> torch.Tensor:
        """(n, ...) on each rank -> (W·n_max, ...): every rank's rows, each padded with `fill` to n_max."""
        if x.shape[0] < n_max:
            x = torch.cat([x, x.new_full((n_max - x.shape[0], *x.shape[1:]), fill)])
        out = x.new_empty((self.world * n_max, *x.shape[1:]))
        all_gather_into(out.view(-1), x.contiguous().view(-1), self.group, self.counter, label="vocab")
        return out

    def scatter_sum(self, full: torch.Tensor, *, gradient: bool = False,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
        """(W·n_max, H) partial sums on each rank -> (n_max, H): this rank's rows of the sum over ranks. A `gradient`
        in a narrower dtype than engine.reduce_dtype is summed in the reduce dtype, as every gradient sum of the
        engine: cast up before the collective, back after. It goes in blocks of every rank's rows (`reduce_blocks`),
        each copy no larger than `full`, written into `scratch` (a buffer the caller is done with, the gathered
        hidden states) when it is large enough: one fp32 copy of a W·b·s·H bf16 gradient was +0.22 GiB at the
        peak of an 8-GPU Llama-3.1-8B run (plan --simulate). The embedding's sum is exact in any dtype (one
        rank's value plus zeros) and stays in its own."""
        n_max = full.shape[0] // self.world
        out = full.new_empty((n_max, *full.shape[1:]))
        if not gradient or full.dtype == self.reduce_dtype:
            reduce_scatter_into(out.view(-1), full.view(-1), self.group, self.counter, full_is_scratch=True,
                                label="vocab")
            return out
        parts = full.view(self.world, n_max, *full.shape[1:])
        rows = max(1, n_max // reduce_blocks(full.dtype, self.reduce_dtype))  # each block's copy fits `scratch`
        for a in range(0, n_max, rows):
            block = parts[:, a:a + rows]
            up = _buffer(scratch, block.shape, self.reduce_dtype, full.device).copy_(block)
            summed = up.new_empty(up.shape[1:])
            reduce_scatter_into(summed.view(-1), up.view(-1), self.group, self.counter, full_is_scratch=True,
                                label="vocab")
            out[a:a + rows].copy_(summed)
        return out

    # -- the three uses -----------------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        return _Embed.apply(w, ids, self).view(*ids.shape, self.hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        lead = hidden.shape[:-1]
        return _Logits.apply(hidden.reshape(-1, self.hidden), w, self).view(*lead, self.num_rows)

    def cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        """sum_t CE(hidden[t] @ table^T, targets[t]) over this rank's targets != IGNORE (fp32 scalar)."""
        return _CrossEntropy.apply(hidden, self.weight(), targets, self, chunk_tokens)


def _buffer(scratch: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over the bytes of `scratch` (contiguous, large enough), else a new one."""
    nbytes = shape.numel() * dtype.itemsize
    if scratch is None or not scratch.is_contiguous() or scratch.nbytes < nbytes:
        return torch.empty(shape, dtype=dtype, device=device)
    return scratch.view(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)


def reduce_blocks(dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    """Blocks a gradient in `dtype` is summed in, in `reduce_dtype` (scatter_sum; the plan sizes its copy with it)."""
    return -(-reduce_dtype.itemsize // dtype.itemsize)


class _RowsToDevice(torch.autograd.Function):
    """cpu_offload, trainable table: the host rows' device copy (`staged`) as a function of the host segment. Its
    backward hands the rows' gradient to the table (`grad_to_host`: a non-blocking D2H, added into the segment's
    gradient on the host later) and none to autograd, whose AccumulateGrad would read a host gradient at once:
    a blocking copy into pageable memory."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, staged: torch.Tensor, table: VocabTable) -> torch.Tensor:
        ctx.table = table
        return staged.view_as(staged)  # a fresh tensor object per use: each gets its own grad_fn

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.table.grad_to_host(grad)
        return None, None, None


def _add_grad(segment: torch.Tensor, host: torch.Tensor) -> None:
    """A landed copy of a table's gradient into the segment's: the copy itself is the first (its buffer stays the
    gradient until the optimizer drops it), later ones are added."""
    if segment.grad is None:
        segment.grad = host
    else:
        segment.grad.add_(host)


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, table: VocabTable) -> torch.Tensor:
        flat_ids = ids.reshape(-1)
        n = flat_ids.numel()
        n_max = table.max_tokens(n, first=True)
        ids_all = table.gather(flat_ids, n_max, fill=-1)
        local = ids_all - table.lo
        mine = (local >= 0) & (local < table.num_local)
        local = local.masked_fill(~mine, 0)
        if table.num_local:
            out_all = F.embedding(local, weight)
            out_all.masked_fill_(~mine[:, None], 0)
        else:
            out_all = weight.new_zeros((ids_all.numel(), table.hidden))
        out = table.scatter_sum(out_all)[:n]
        ctx.table, ctx.n, ctx.n_max = table, n, n_max
        ctx.save_for_backward(local, mine)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        table = ctx.table
        local, mine = ctx.saved_tensors
        grad_all = table.gather(grad.contiguous(), ctx.n_max)
        # Accumulated in fp32, as nn.Embedding's CUDA backward does: a frequent token's row sums thousands of
        # vectors, which a bf16 sum rounds away. Autograd casts the result to the weight's dtype once.
        gw = grad.new_zeros((table.num_local, table.hidden), dtype=torch.float32)
        if table.num_local:  # no boolean indexing: no device sync, and the simulated GPU (meta) runs it
            gw.index_add_(0, local, grad_all.masked_fill_(~mine[:, None], 0).float())
        p = table.padding_idx
        if p is not None and 0 <= p - table.lo < table.num_local:
            gw[p - table.lo] = 0  # nn.Embedding(padding_idx=p): that row never trains
        return gw, None, None


class _Logits(torch.autograd.Function):
    """Full-vocabulary logits of this rank's tokens from the row-sharded head (one all-to-all each way)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, table: VocabTable) -> torch.Tensor:
        n = hidden.shape[0]
        n_max = table.max_tokens(n)
        W, R = table.world, table.rows_per_rank
        h_all = table.gather(hidden.to(weight.dtype), n_max)
        local = hidden.new_zeros((W * n_max, R), dtype=weight.dtype)
        if table.num_local:
            local[:, :table.num_local] = h_all @ weight.t()
        mine = torch.empty_like(local)
        all_to_all_into(mine.view(-1), local.view(-1), table.group, table.counter, label="vocab")
        # mine[q] = rank q's columns for my tokens: (W, n_max, R) -> (n_max, W·R) -> drop padding rows and columns
        logits = mine.view(W, n_max, R).permute(1, 0, 2).reshape(n_max, W * R)[:n, :table.num_rows].contiguous()
        ctx.table, ctx.n, ctx.n_max = table, n, n_max
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(h_all, weight)
        return logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        table, n, n_max = ctx.table, ctx.n, ctx.n_max
        h_all, weight = ctx.saved_tensors
        W, R = table.world, table.rows_per_rank
        padded = grad.new_zeros((n_max, W * R), dtype=weight.dtype)
        padded[:n, :table.num_rows] = grad
        send = padded.view(n_max, W, R).permute(1, 0, 2).contiguous()
        recv = torch.empty_like(send)
        all_to_all_into(recv.view(-1), send.view(-1), table.group, table.counter, label="vocab")
        g = recv.view(W * n_max, R)[:, :table.num_local]
        grad_h = table.scatter_sum(g @ weight, gradient=True)[:n].to(ctx.hidden_dtype) if ctx.needs_input_grad[0] \
            else None
        grad_w = g.t() @ h_all if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None


class _CrossEntropy(torch.autograd.Function):
    """engine/loss.py's chunked linear cross-entropy over a row-sharded head: gradients formed in forward, scaled in
    backward. Chunks run over the gathered tokens of the whole shard group (C x R fp32 logits alive)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, table: VocabTable,
                chunk_tokens: int) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        n_max = table.max_tokens(n)
        h_all = table.gather(hidden.to(weight.dtype), n_max)
        t_all = table.gather(targets, n_max, fill=IGNORE)
        mine_lo, mine_hi = table.rank * n_max, table.rank * n_max + n  # this rank's tokens among the gathered
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h_all = torch.empty_like(h_all) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None  # summed in fp32 (engine/loss.py)
        k = table.num_local
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, h_all.shape[0])
        for start in range(0, h_all.shape[0], chunk):
            stop = min(start + chunk, h_all.shape[0])
            h, t = h_all[start:stop], t_all[start:stop]
            ignored = t == IGNORE
            local_t = t - table.lo
            here = (local_t >= 0) & (local_t < k) & ~ignored
            logits = (h @ weight.t()).float()  # C x R: the only logits alive
            if k:
                picked = logits.gather(1, local_t.clamp(0, k - 1)[:, None]).squeeze(1).masked_fill(~here, 0.0)
                # the local log-sum-exp with no C x R temporary (engine/loss.py softmax_lse_): the logits become
                # the local softmax, exp(x - lse_loc)
                lse_loc = softmax_lse_(logits)
            else:  # this rank holds padding rows only: exp(-inf) = 0 of the sum
                lse_loc = torch.full((h.shape[0],), float("-inf"), device=h.device)
                picked = torch.zeros(h.shape[0], device=h.device)
            # One all-gather of two numbers per token: the log-sum-exp over all rows is that of the local ones
            stats = table.gather(torch.stack([lse_loc, picked], dim=1), h.shape[0]).view(table.world, h.shape[0], 2)
            lse = torch.logsumexp(stats[..., 0], dim=0)
            loss = (lse - stats[..., 1].sum(dim=0)).masked_fill(ignored, 0.0)
            a, b = max(mine_lo, start) - start, min(mine_hi, stop) - start
            if a < b:
                total += loss[a:b].sum()
            if not (want_h or want_w):
                continue
            g = logits.mul_((lse_loc - lse).exp_()[:, None])  # softmax over the whole vocabulary, local columns
            if k:
                g.scatter_add_(1, local_t.clamp(0, k - 1)[:, None], -here.float()[:, None])
            g.masked_fill_(ignored[:, None], 0.0)
            g = g.to(weight.dtype)
            if want_h:
                torch.mm(g, weight, out=grad_h_all[start:stop])
            if want_w:
                add_outer_fp32(grad_w, g, h)
            del logits, g
        # my tokens' gradient, summed over rows; the gathered hidden states' bytes take its reduce-dtype copies
        grad_h = table.scatter_sum(grad_h_all, gradient=True, scratch=h_all)[:n] if want_h else None
        del grad_h_all, h_all
        ctx.table = table
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from shardtune.engine.loss import scale_saved_grads

        grad_h, grad_w = ctx.saved_tensors
        if grad_w is not None:
            # The local rows' gradient sums every rank's tokens, each rank's loss scaled by its own grad_out: the
            # trainer's scale (1 / the global batch's target count) is the same on every rank. Checked on the
            # device (an asynchronous assert: no host read; a failure surfaces at the next sync).
            table = ctx.table
            scales = table.gather(grad_out.reshape(1).float(), 1)
            torch._assert_async((scales == scales[0]).all(), "vocab-parallel loss: ranks backpropagated different "
                                "scales into one loss; scale every rank's loss alike (or engine.vocab_parallel=false)")
        return (*scale_saved_grads(grad_h, grad_w, grad_out, ctx.hidden_dtype), None, None, None)


def install(table: VocabTable, embedding: nn.Module | None, head: nn.Module | None) -> None:
    """Route the embedding's and the head's forward to the table (their weight left the modules at shard time).
    engine/loss.py finds the head's table through `_shardtune_vocab` and computes the chunked loss on it."""
    if embedding is not None:
        embedding.forward = table.embed
        embedding._shardtune_vocab = table
    if head is not None:
        head.forward = table.logits
        head._shardtune_vocab = table
