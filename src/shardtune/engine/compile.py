"""engine.compile: regional torch.compile, one decoder block (unit) at a time, as torchtitan and torchtune do.

Each unit's `forward` (the instance attribute, not the module's `__call__`) becomes a compiled function, so the
engine's hooks stay outside the compiled region: the forward pre-hook that all-gathers the unit and rebinds its
parameter views, the post-hook that frees it and the hooks on its outputs run eagerly around the compiled call, and
the compiled graph sees the gathered views as ordinary tensor inputs (no recompile when they are rebound each step).

`fullgraph=True`: a graph break inside a block raises instead of silently running part of it eagerly. What dynamo
cannot trace, QLoRA's tiled NF4 matmuls and the experts' grouped matmul, runs as one custom op each
(torch.library ops beside the eager code they run: model/experts.py grouped_mm_op, engine/nf4_linear.py
nf4_linear_op, engine/nf4_experts.py nf4_grouped_linear, model/attention.py document_attention_op; each called
where `torch.compiler.is_compiling()`).
Static shapes (`dynamic=False`): every row of a run is data.seq_len long (packed, or padded), so a run has one shape
and compiles once per block class. A symbolic sequence length buys nothing here: the attention's host document
lengths (model/attention.py) are Python ints that would specialize it anyway. `run` below hands the attention the
row length instead (unpacked rows: one constant per run), or the documents as a host tensor of a fixed shape
(packed rows: a graph input, read by attention.document_attention_op).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtune.engine.wrap import find_units


def compile_units(model: nn.Module, unit_classes: tuple[type[nn.Module], ...],
                  min_unit_params: int | None = None, *, packed: bool = False) -> list[nn.Module]:
    """Replace every unit's forward by its compiled version (lazy: dynamo traces at the first call); returns them.
    `packed`: rows hold several documents (data.packing)."""
    units = find_units(model, unit_classes, min_unit_params)
    for unit in units:
        _peft_lora_forward(unit)
        unit.forward = _training_only(unit.forward, packed=packed)
    # Past dynamo's recompile limit a function runs eagerly from then on, with a warning: raise instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return units


def _training_only(forward: Callable[..., Any], *, packed: bool) -> Callable[..., Any]:
    """The compiled forward where gradients are on (the training step, its recompute); eval's and generate's
    no-grad forwards (KV cache, one token at a time) run the block eagerly rather than compile another graph."""
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        lengths = kwargs.get("doc_lengths")
        if lengths is not None and packed:
            kwargs["doc_lengths"] = _lengths_tensor(lengths)
        elif lengths is not None:
            # Unpacked rows: a document, then padding. The document lengths change every batch, and dynamo guards on
            # them (a recompile each); one causal attention over the whole row computes the document's tokens exactly
            # the same (they never see the padding after them), and the row length is the run's one constant.
            kwargs["doc_lengths"] = tuple((sum(row),) for row in lengths)
        return compiled(*args, **kwargs)
    return run


_LAST: list[tuple[Any, torch.Tensor]] = []  # the last batch's documents and their tensor: every block asks again


def _lengths_tensor(lengths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Packed rows' document lengths as a host int64 tensor (rows, row length), zero-padded: the same shape every
    batch of a run, so the graph takes it as an input instead of specializing on the lengths."""
    if _LAST and _LAST[0][0] is lengths:
        return _LAST[0][1]
    t = torch.zeros(len(lengths), sum(lengths[0]), dtype=torch.int64)
    for i, row in enumerate(lengths):
        t[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    _LAST[:] = [(lengths, t)]
    return t


def _peft_lora_forward(unit: nn.Module) -> None:
    """LoRA Linears inside a compiled block take peft's forward back (their class becomes peft's lora.Linear again):
    model/lora_linear.py's one autograd Function passes A and B twice in fp32 (as themselves and as their compute
    copies), which dynamo refuses to trace (a graph break), and inductor fuses peft's casts and sum itself."""
    if "shardtune.model.lora_linear" not in sys.modules:
        return  # no LoRA in this run
    from shardtune.model.lora_linear import fused_class

    fused = fused_class()
    for m in unit.modules():
        if type(m) is fused:
            m.__class__ = fused.__mro__[1]
