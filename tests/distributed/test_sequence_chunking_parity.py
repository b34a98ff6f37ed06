"""engine.mlp_chunk_tokens (model/tiled_mlp.py: the MLP, the RMSNorms and the LoRA adapter branches over sequence chunks)
with activation checkpointing and offloaded activations on 2 ranks, on packed rows of three documents through the
per-document attention, against one process running the plain block: per-step loss within 1e-5 relative (fp32), for
full fine-tuning, LoRA and QLoRA; and QLoRA on one rank (its NF4 shard aliased as the gathered buffer). Chunks of 6
tokens over 2 rows of 16: they cut across documents."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, policy_for
from tests.distributed.harness import run_distributed
from tests.distributed.test_chunked_loss import _model
from tests.distributed.test_offload_activations_parity import _document_model, _packed_steps, packed_reference

from shardtune.engine import shard as shardtune_backend
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units
from shardtune.model.lora import is_adapter
from shardtune.model.tiled_mlp import apply_sequence_chunking

CPU = torch.device("cpu")
CHUNK = 6


def _parity(mode: str) -> None:
    ref = packed_reference(mode)
    model = _model("tiny-llama", mode, build=_document_model)
    policy = policy_for(model, "full_shard", world=dist.get_world_size(), offload_activations=True,
                        activation_checkpointing=True, mlp_chunk_tokens=CHUNK)
    if mode != "full":
        policy = dataclasses.replace(policy, replicated=lambda n, p: is_adapter(n), quantize_base=mode == "qlora")
    units = find_units(model, policy.unit_classes, policy.min_unit_params)
    changed = apply_sequence_chunking(units, chunk_tokens=policy.mlp_chunk_tokens)
    # Llama: the post-attention norm runs inside the MLP's chunks, the input norm on its own
    assert len(changed["mlp"]) == len(changed["fused"]) == len(changed["norms"]) == len(units)
    assert len(changed["adapters"]) == (0 if mode == "full" else 3 * len(units))  # q, v, down
    offloader = ActivationOffloader(CPU)
    apply_activation_checkpointing(model, policy.unit_classes, offloader=offloader)
    sharded = shardtune_backend.shard_model(model, policy, device=CPU)
    if mode == "qlora" and dist.get_world_size() == 1:  # one rank: the NF4 shard is the gathered buffer, not copied
        nf4 = [f for u in sharded.units for f in u.flats if f.dtype == torch.uint8]
        assert nf4 and all(f.aliased and f.full.data_ptr() == f.shard.data_ptr() for f in nf4)
    losses = _packed_steps(model, sharded, adamw(sharded.optimizer_param_groups(0.1)))
    assert offloader.num_offloaded > 0
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (mode, step, got, want)


def test_sequence_chunked_block_matches_plain_on_two_ranks():
    run_distributed(_parity, 2, [{"mode": m} for m in ("full", "lora", "qlora")])


def test_sequence_chunked_qlora_matches_plain_on_one_rank():
    run_distributed(_parity, 1, [{"mode": "qlora"}])
