"""engine.context_parallel on 2 ranks against one process (fp32): packed rows of several documents, full
fine-tuning, LoRA and QLoRA, and full fine-tuning with the long-context options together (activation checkpointing
with offloaded inputs, the sequence-tiled MLP, the chunked loss). Both ranks read the same rows and each runs half
of every row: per-step loss within 1e-5 relative over 4 optimizer steps, so the gradients (which make steps 2-4)
match too. Rank 1's half starts inside the second document and after the whole first one: the attention's
zero-query padding and its skipped document both run. One spawn for the grid."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, policy_for
from tests.distributed.harness import run_distributed
from tests.distributed.test_chunked_loss import _model
from tests.distributed.test_offload_activations_parity import DOCS, _document_model, packed_reference

from shardtune.data import packing
from shardtune.data.formats import IGNORE
from shardtune.engine import shard as shardtune_backend
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units
from shardtune.model import context_parallel
from shardtune.model.tiled_mlp import apply_sequence_chunking
from shardtune.trainer.parallelize import enable_context_parallel

ROWS = 4
CPU = torch.device("cpu")


def _cp_steps(model, opt, *, chunk: int, steps: int = 4) -> list[float]:
    """test_offload_activations_parity's packed batches, every row on every rank: the context-parallel loss splits the rows itself."""
    pos = torch.cat([torch.arange(n) for n in DOCS]).expand(ROWS, -1)
    lengths = packing.doc_lengths(pos.numpy())
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(3, 128, (ROWS, sum(DOCS)), generator=g)
        labels = ids.clone()
        labels[:, [0, DOCS[0], DOCS[0] + DOCS[1]]] = IGNORE
        total = int((labels[:, 1:] != IGNORE).sum())
        loss = token_loss_sum(model, ids, labels, pos, chunk_tokens=chunk, doc_lengths=lengths) / total
        loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _cp_parity(mode: str, long_context: bool = False) -> None:
    ref = packed_reference(mode)
    model = _model("tiny-llama", mode, build=_document_model)
    policy = policy_for(model, "full_shard", world=dist.get_world_size(),
                        lora={"full": None, "lora": "lora", "qlora": "nf4"}[mode])
    offloader = None
    if long_context:
        policy = dataclasses.replace(policy, offload_activations=True, mlp_chunk_tokens=4)
        apply_sequence_chunking(find_units(model, policy.unit_classes, policy.min_unit_params), chunk_tokens=4)
        offloader = ActivationOffloader(CPU)
        apply_activation_checkpointing(model, policy.unit_classes, offloader=offloader)
    seen: list[tuple[int, ...]] = []
    model.model.layers[0].register_forward_pre_hook(lambda m, args, kw: seen.append(tuple(args[0].shape))
                                                     if args else seen.append(tuple(kw["hidden_states"].shape)),
                                                     with_kwargs=True)
    sharded = shardtune_backend.shard_model(model, policy, device=CPU)
    enable_context_parallel(sharded, on=True)
    try:
        losses = _cp_steps(model, adamw(sharded.optimizer_param_groups(0.1)), chunk=8 if long_context else 0)
    finally:
        context_parallel.disable()
    half = sum(DOCS) // dist.get_world_size()
    assert seen and all(s[:2] == (ROWS, half) for s in seen), seen  # each rank ran its half of every row
    if offloader is not None:
        assert offloader.num_offloaded > 0 and not offloader._stash
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)


def test_context_parallel_equals_one_process():
    settings = [{"mode": m} for m in ("full", "lora", "qlora")] + [{"mode": "full", "long_context": True}]
    run_distributed(_cp_parity, 2, settings)

