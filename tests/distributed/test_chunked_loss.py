"""The chunked loss (train.loss_chunk_tokens) and the tiled NF4 linear (engine.nf4_tile_mb) on sharded models: 8 steps
of full fine-tuning, LoRA and QLoRA on 4 ranks (full_shard and hybrid 2 x 2), both backends, equal single-process training on today's path (full
fp32 logits, torchao's whole-weight NF4 matmul), per step within 1e-5 relative. tiny-qwen2 ties its embedding and
head. One spawn for the whole grid."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from tests.distributed.common import (
    adamw,
    build_model,
    computed_by_one_rank,
    global_batch,
    num_targets,
    policy_for,
)
from tests.distributed.harness import run_distributed
from tests.distributed.test_lora import LORA
from tests.distributed.test_qlora import block_linears, reference_nf4

from shardtune.engine import shard as shardtune_backend
from shardtune.engine import torch_backend
from shardtune.engine.loss import supports_chunked_loss, token_loss_sum
from shardtune.engine.nf4_linear import TiledNF4Tensor
from shardtune.model.lora import apply_lora

NUM_STEPS = 8
CHUNK = 5  # tokens per chunk: does not divide a rank's 2*16 tokens
TILE = 4096  # bytes per NF4 tile: 8 of tiny-llama's 128 x 128 fp32 rows, so every weight takes several tiles


def _model(name: str, mode: str, build=build_model):
    """The named tiny model; LoRA (seed 1) unless full fine-tuning."""
    model = build(name)
    if mode != "full":
        torch.manual_seed(1)
        apply_lora(model, LORA)
    return model


def _steps(model, sharded, opt, *, chunk: int, batch=global_batch) -> list[float]:
    """NUM_STEPS steps of the sum CE / global target tokens on this rank's slice of `batch(step)`."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded is not None else (0, 1)
    losses = []
    for step in range(NUM_STEPS):
        ids, labels = batch(step)
        total = num_targets(labels)
        ids, labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        loss = token_loss_sum(model, ids, labels, pos, chunk_tokens=chunk) / total
        loss.backward()
        loss = loss.detach()
        if sharded is not None:
            dist.all_reduce(loss)
            sharded.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@functools.cache
def _reference(name: str, mode: str) -> list[float]:
    """One process, today's path: full logits, torchao's whole-weight NF4 matmul for QLoRA (run by one rank)."""
    def run() -> list[float]:
        model = _model(name, mode)
        if mode == "qlora":
            nf4_reference_weights(model)
        return _steps(model, None, adamw(model), chunk=0)
    return computed_by_one_rank(f"chunked {name} {mode}", run)


def nf4_reference_weights(model) -> None:
    """The blocks' Linear weights as torchao NF4Tensors: the single-process QLoRA reference (whole-weight matmul)."""
    for _, m in block_linears(model):
        w = reference_nf4(m.weight)
        del m._parameters["weight"]
        m.weight = w


def _parity(name: str, mode: str, backend: str, strategy: str = "full_shard", tile: int = 0) -> None:
    ref = _reference(name, mode)
    model = _model(name, mode)
    policy = policy_for(model, strategy, world=dist.get_world_size(), lora={"full": None, "lora": "lora", "qlora": "nf4"}[mode])
    if mode == "qlora":  # the grid's tile size (0: torchao's whole-weight matmul)
        policy = dataclasses.replace(policy, nf4_tile_bytes=tile)
    if backend == "torch":
        if mode == "qlora":
            from shardtune.engine.layout import group_unit_params
            from shardtune.engine.nf4 import quantize_parameters

            quantize_parameters(model, [e for up in group_unit_params(model, policy) for e in up.quantized],
                                torch.float32)
        sharded = torch_backend.shard_model(model, policy, device=torch.device("cpu"))
    else:
        sharded = shardtune_backend.shard_model(model, policy, device=torch.device("cpu"))
    assert supports_chunked_loss(model)  # the fused path from the first step (no weight bound before a forward)
    losses = _steps(model, sharded, adamw(sharded.optimizer_param_groups(0.1)), chunk=CHUNK)
    if tile:  # the matmuls ran on the tiled path
        assert any(isinstance(m.__dict__.get("weight"), TiledNF4Tensor) for m in model.modules())
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    # Eval (no_grad): our engine frees the root right after its forward; the loss is computed while it is gathered.
    ids, labels = (t.chunk(dist.get_world_size())[dist.get_rank()] for t in global_batch(NUM_STEPS))
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        got, want = (token_loss_sum(model, ids, labels, pos, chunk_tokens=c) for c in (CHUNK, 0))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_chunked_loss_parity():
    """4 ranks: full_shard and hybrid_shard (2 x 2) on our engine, full_shard on FSDP2 (tied head and embedding:
    the chunked loss's head gradient goes through FSDP2's unsharded root parameter)."""
    settings = [{"name": "tiny-llama", "mode": "full", "backend": "shardtune", "strategy": "hybrid_shard"},
                {"name": "tiny-qwen2", "mode": "full", "backend": "shardtune", "strategy": "full_shard"},
                {"name": "tiny-qwen2", "mode": "lora", "backend": "shardtune", "strategy": "hybrid_shard"},
                {"name": "tiny-llama", "mode": "qlora", "backend": "shardtune", "strategy": "full_shard", "tile": TILE},
                {"name": "tiny-qwen2", "mode": "full", "backend": "torch"}]
    run_distributed(_parity, 4, settings)
