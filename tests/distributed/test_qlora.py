"""QLoRA (lora.quantize_base=nf4): the NF4 base sharded and all-gathered as bytes.

- parity: 8 steps of fp32-compute QLoRA at 2 and 4 ranks (full_shard, hybrid 2x2) give the per-step losses of a
  single-process reference within 1e-5 relative; the reference is plain torchao QLoRA (each frozen block Linear's
  weight replaced by `to_nf4(weight)`), not our engine; adapters are bit-identical across ranks after every step;
- the quantized base is the same at every world size: each rank's shard is its slice of the world-independent
  bytes, and the gathered, dequantized weights equal `to_nf4(weight)`'s exactly;
- bytes: per-step all-gather bytes <= 0.30x and per-rank block base bytes <= 0.27x those of the bf16 base;
- loading (model.init=pretrained) quantizes while reading: peak ~ shard + one bf16 tensor;
- engine.backend=torch (FSDP2 + torchao NF4 parameters) trains to the same losses.
"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from tests.distributed.common import (
    adamw,
    build_model,
    global_batch,
    nf4_chunks_relative,
    num_targets,
    policy_for,
    token_loss_sum,
    train_step,
)
from tests.distributed.harness import run_distributed
from tests.distributed.test_lora import LORA, lora_model, lora_policy
from torch import nn
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
from transformers import AutoModelForCausalLM

from shardtune.engine.nf4_layout import scaler_block
from shardtune.engine.quantized import QuantizedFlat
from shardtune.engine.shard import shard_model
from shardtune.memory import CpuMemoryTracker
from shardtune.model.loading import build_empty, load_into_shards
from shardtune.model.lora import apply_lora, is_adapter
from shardtune.trainer.parallelize import materialize_adapters

NUM_STEPS = 8


def qlora_policy(model, *, strategy: str = "full_shard", param_dtype=torch.float32):
    """The product's QLoRA policy (lora.quantize_base=nf4)."""
    return policy_for(model, strategy, world=dist.get_world_size(), param_dtype=param_dtype, lora="nf4")


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linears QLoRA quantizes: inside the decoder blocks (not lm_head), not adapters."""
    return [(n, m) for n, m in model.named_modules()  # peft's LoRA wrapper is not an nn.Linear; its base_layer is
            if isinstance(m, nn.Linear) and ".layers." in n and ".lora_" not in n]


def reference_nf4(weight: torch.Tensor, dtype: torch.dtype = torch.float32):
    return to_nf4(weight.detach().to(dtype), 64, scaler_block(weight.numel()))


@functools.cache  # once per rank process: both parity settings of a spawn share it
def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Single-process torchao QLoRA: per-step losses, adapters after each step, dequantized base weights."""
    ref = lora_model()
    base = {}
    for name, m in block_linears(ref):
        w = reference_nf4(m.weight)
        del m._parameters["weight"]
        m.weight = w  # F.linear on an NF4Tensor is torchao's linear_nf4
        base[f"{name}.weight"] = w.get_original_weight()
    opt = adamw(ref)  # the same decay groups as the engine's; the NF4 weights are attributes, not parameters
    losses, adapters = [], []
    for s in range(NUM_STEPS):
        losses.append(train_step(ref, None, opt, s, accum=1, sync_each=True)[0])
        adapters.append({n: p.detach().clone() for n, p in ref.named_parameters() if is_adapter(n)})
    return losses, adapters, base


def _parity(strategy: str) -> None:
    world = dist.get_world_size()
    ref_losses, ref_adapters, ref_base = _reference()
    model = lora_model()
    sharded = shard_model(model, qlora_policy(model, strategy=strategy), device=torch.device("cpu"))
    quantized = [f for u in sharded.units for f in u.flats if isinstance(f, QuantizedFlat)]
    assert len(quantized) == len(sharded.units) - 1  # one per decoder block, none in the root
    assert {s.name for f in quantized for s in f.slots} == set(ref_base)
    opt = adamw(sharded.optimizer_param_groups(0.1))
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for step in range(NUM_STEPS):
        loss, _ = train_step(model, sharded, opt, step, accum=1, sync_each=True)
        assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (step, loss, ref_losses[step])
        for n, p in adapters.items():
            gathered = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(gathered, p.detach())
            assert all(torch.equal(g, gathered[0]) for g in gathered), (step, n)  # bit-identical replicas
            torch.testing.assert_close(p.detach(), ref_adapters[step][n], rtol=1e-4, atol=1e-6)
    _same_base_at_every_world_size(sharded, quantized, ref_base)


def _same_base_at_every_world_size(sharded, quantized: list[QuantizedFlat], ref_base) -> None:
    """The bytes do not depend on the world size: a shard is a slice of the world-1 buffer (built here with one
    rank's layout), and what the matmuls use equals torchao's to_nf4 of the whole weight, bit for bit."""
    fresh = dict(lora_model().named_parameters())  # the same seeded weights, unsharded
    for flat in quantized:
        one = QuantizedFlat([(s.name, fresh[s.name], []) for s in flat.slots], nf4_dtype=flat.nf4_dtype,
                            shard_rank=0, shard_size=1, device=torch.device("cpu"))
        assert flat.shard_numel % 32 == 0  # shard boundaries fall between 32-byte code blocks
        lo = flat.shard_rank * flat.shard_numel
        mine = one.shard[lo:lo + flat.shard_numel]
        assert torch.equal(flat.shard[:mine.numel()], mine) and not flat.shard[mine.numel():].any()
    full = dict(sharded.full_state_dict())
    if dist.get_rank() == 0:
        for name, w in ref_base.items():
            assert torch.equal(full[name], w), name


def _bytes() -> None:
    """bf16 compute both: QLoRA's per-step all-gather bytes and block base bytes against the bf16 base's."""
    out = {}
    for nf4 in (False, True):
        model = lora_model()
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)  # what parallelize does under bf16 + LoRA
        policy = (qlora_policy if nf4 else lora_policy)(model, param_dtype=torch.bfloat16)
        sharded = shard_model(model, policy, device=torch.device("cpu"))
        opt = adamw(sharded.optimizer_param_groups(0.1))
        counter = sharded.ctx.counter
        train_step(model, sharded, opt, 0, accum=1, sync_each=True)  # warm-up: same collectives every step
        before = sum(b for (op, _), b in counter.by_op.items() if op == "all_gather")
        train_step(model, sharded, opt, 1, accum=1, sync_each=True)
        gathered = sum(b for (op, _), b in counter.by_op.items() if op == "all_gather") - before
        base = sum(f.shard.nbytes for u in sharded.units[:-1] for f in u.flats if not f.requires_grad)
        out[nf4] = gathered, base
    (ag_bf16, base_bf16), (ag_nf4, base_nf4) = out[False], out[True]
    assert ag_nf4 <= 0.30 * ag_bf16, (ag_nf4, ag_bf16)
    assert base_nf4 <= 0.27 * base_bf16, (base_nf4, base_bf16)
    if dist.get_rank() == 0:
        print(f"qlora/bf16: all-gather {ag_nf4 / ag_bf16:.3f}, block base {base_nf4 / base_bf16:.3f}")


def _eval_no_grad() -> None:
    """Under no_grad (eval, generate) every unit is freed after its forward; logits match the reference."""
    model = lora_model()
    sharded = shard_model(model, qlora_policy(model), device=torch.device("cpu"))
    ids, labels = global_batch(0)
    with torch.no_grad():
        loss = token_loss_sum(model, ids, labels) / num_targets(labels)
    assert torch.isfinite(loss)
    assert all(not f.is_full_allocated() for u in sharded.units for f in u.flats if isinstance(f, QuantizedFlat))


def _load(root: str) -> None:
    """model.init=pretrained + nf4: each rank quantizes while loading, per unit, reading each weight in chunks; peak
    <= its shards + one bf16 tensor (the tracker counts a safetensors slice as its whole tensor's storage, so any read
    is "one tensor"), plus the chunk copied out of it (<= 1/64 of it) and its block absmaxes (1/64 of its elements);
    the base equals to_nf4 of the checkpoint's weights, bit for bit."""
    path = Path(root) / "bf16"
    if dist.get_rank() == 0:
        build_model("tiny-llama", seed=3).to(torch.bfloat16).save_pretrained(path, max_shard_size="300KB")
    dist.barrier()
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16)
    largest_bf16 = max(p.numel() for p in ref.parameters()) * 2
    model = build_empty(lambda: AutoModelForCausalLM.from_config(ref.config, attn_implementation="eager",
                                                                 dtype=torch.float32))
    apply_lora(model, LORA)
    materialize_adapters(model, seed=0)  # as parallelize: peft created the adapters on meta too (fp32)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # as parallelize under bf16 + LoRA (meta: no bytes)
    tracker = CpuMemoryTracker().start()
    start = tracker.live_bytes()
    sharded = shard_model(model, qlora_policy(model, param_dtype=torch.bfloat16), device=torch.device("cpu"))
    flats = [f for u in sharded.units for f in u.flats]
    with nf4_chunks_relative():
        load_into_shards(flats, model, path)
    peak = tracker.peak_bytes() - start
    tracker.stop()
    shard_bytes = sum(f.shard.nbytes for f in flats)
    assert peak <= shard_bytes + largest_bf16 * (1 + 2 / 64), (peak, shard_bytes, largest_bf16)
    full = dict(sharded.full_state_dict())
    if dist.get_rank() == 0:
        weights = dict(ref.named_parameters())
        for name, m in block_linears(ref):
            got = full[_peft_name(full, name)]
            torch.testing.assert_close(got, reference_nf4(m.weight, torch.bfloat16).get_original_weight(), rtol=0,
                                       atol=0)
        assert full["model.embed_tokens.weight"].dtype == torch.bfloat16  # the root is not quantized
        torch.testing.assert_close(full["model.embed_tokens.weight"], weights["model.embed_tokens.weight"].detach())


def _peft_name(full: dict, name: str) -> str:
    """HF name of a block Linear -> the name it has in the LoRA model (targeted ones hold it as base_layer)."""
    lora = f"{name}.base_layer.weight"
    return lora if lora in full else f"{name}.weight"


def _fsdp2() -> None:
    """engine.backend=torch: the same NF4 weights as NF4Tensor parameters under FSDP2 (torchao's all-gather hooks)
    train to the reference's losses."""
    from shardtune.engine import torch_backend
    from shardtune.engine.layout import group_unit_params
    from shardtune.engine.nf4 import quantize_parameters

    ref_losses, _, _ = _reference()
    model = lora_model()
    policy = qlora_policy(model)
    quantize_parameters(model, [e for up in group_unit_params(model, policy) for e in up.quantized], torch.float32)
    sharded = torch_backend.shard_model(model, policy, device=torch.device("cpu"))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    for step in range(NUM_STEPS):
        loss, _ = train_step(model, sharded, opt, step, accum=1, sync_each=True)
        assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (step, loss, ref_losses[step])


def _all(kind: str, **kw) -> None:
    {"parity": _parity, "bytes": _bytes, "eval": _eval_no_grad, "load": _load, "fsdp2": _fsdp2}[kind](**kw)


def test_qlora_2_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_all, 2, [dict(kind="parity", strategy="full_shard"), dict(kind="bytes"), dict(kind="eval"),
                                  dict(kind="load", root=tmp), dict(kind="fsdp2")])


def test_qlora_4_ranks() -> None:
    run_distributed(_all, 4, [dict(kind="parity", strategy="full_shard"),
                              dict(kind="parity", strategy="hybrid_shard")])
