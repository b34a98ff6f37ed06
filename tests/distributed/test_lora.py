"""LoRA over a frozen sharded base: parity with single-process LoRA, replicated adapters, no base gradients or
reduce-scatter, one adapter all-reduce per synced backward, early free of frozen units, bf16 base, PEFT `final/`."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from tests.distributed.common import (
    adamw,
    build_model,
    global_batch,
    num_targets,
    policy_for,
    token_loss_sum,
    train_step,
)
from tests.distributed.harness import run_distributed

from shardtune.config.schema import LoraConfig
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.engine.api import ShardingPolicy
from shardtune.engine.shard import shard_model
from shardtune.engine.unit import ShardState
from shardtune.model.lora import apply_lora, is_adapter
from shardtune.trainer.export import save_final

NUM_STEPS = 6
LORA = LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


# Fewer adapter tensors than 4 ranks (one layer, q_proj: lora_A and lora_B): two ranks own no run of the adapters.
FEW = {"layers": 1, "targets": ["q_proj"]}


def lora_model(seed: int = 0, *, layers: int | None = None, targets: list[str] | None = None):
    model = build_model("tiny-llama", seed=seed, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(seed + 1)  # adapter init: the same on every rank
    return apply_lora(model, LORA if targets is None else LoraConfig(**{**vars(LORA), "target_modules": targets}))


def lora_policy(model, *, strategy: str = "full_shard", param_dtype=torch.float32, shard_states: bool = True,
                vocab_parallel: bool = True) -> ShardingPolicy:
    """The product's LoRA policy; False states engine.shard_adapter_states / engine.vocab_parallel=false."""
    return policy_for(model, strategy, world=dist.get_world_size(), param_dtype=param_dtype, lora="lora",
                      shard_adapter_states=shard_states, vocab_parallel=vocab_parallel)


def ring(numel: int, elem: int, world: int) -> int:
    return 2 * (world - 1) * numel * elem // world


def _reference(accum: int, **model_kw):
    ref = lora_model(**model_kw)
    opt = adamw(ref)  # groups every parameter; frozen ones never get a grad, so AdamW skips them
    out = [train_step(ref, None, opt, s, accum=accum, sync_each=True) for s in range(NUM_STEPS)]
    return out, {n: p.detach().clone() for n, p in ref.named_parameters() if is_adapter(n)}


def _parity(strategy: str, accum: int, sync_each: bool, shard_states: bool = True, once: bool = False,
            model_kw: dict | None = None, vocab_parallel: bool = True) -> None:
    """`shard_states` (the default): each rank steps its own run of the adapters (reduce-scatter, step, all-gather);
    False: every rank steps all (one all-reduce). `once`: the trainer's way, adapters reduced on the last micro-step
    only, no adapter .grad held between micro-steps. `model_kw`: lora_model's (FEW: ranks that own no adapter still
    step, gather and count AdamW's steps). `vocab_parallel=False`: the tables gathered in the root, whose traffic the
    byte count below sums unit by unit."""
    world = dist.get_world_size()
    ref_steps, ref_adapters = _reference(accum, **(model_kw or {}))
    model = lora_model(**(model_kw or {}))
    sharded = shard_model(model, lora_policy(model, strategy=strategy, shard_states=shard_states,
                                             vocab_parallel=vocab_parallel), device=torch.device("cpu"))
    groups = sharded.optimizer_param_groups(0.1)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    n_adapters = sum(p.numel() for p in adapters.values())
    stepped = [p for g in groups for p in g["params"]]
    if shard_states:  # a contiguous run of the adapters per rank, balanced: within one adapter of N/W
        runs = [None] * world
        dist.all_gather_object(runs, [n for n, p in adapters.items() if any(p is q for q in stepped)])
        assert [n for r in runs for n in r] == list(adapters), "every adapter stepped by exactly one rank, in order"
        largest = max(p.numel() for p in adapters.values())
        assert abs(sum(p.numel() for p in stepped) - n_adapters / world) <= largest
    else:  # the optimizer steps exactly the adapters, whole
        assert {id(p) for p in stepped} == {id(p) for p in adapters.values()}
    # The base is frozen: no segments, no shard grads.
    assert all(not f.requires_grad and not f.segments for u in sharded.units for f in u.flats)
    opt = adamw(groups)

    def no_adapter_grads() -> None:  # between micro-steps the local sums wait in the bucket, not in .grad
        assert all(p.grad is None for p in adapters.values())

    for step in range(NUM_STEPS):
        before = sharded.comm_bytes()
        loss, norm = train_step(model, sharded, opt, step, accum=accum, sync_each=sync_each, all_reduce_once=once,
                                between_micro_steps=no_adapter_grads if once or not sync_each else None)
        ref_loss, ref_norm = ref_steps[step]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-7)
        if step == 0 and strategy == "full_shard" and not vocab_parallel:
            # Per micro-step: all-gathers only (forward; backward re-gather but the last unit). Per adapter reduction:
            # one fp32 all-reduce of all adapters, or (sharded) a reduce-scatter of the padded bucket, then one
            # all-gather of it after the optimizer step. The clip's scalar (sharded: one more). No other reduce.
            numels = [sum(f) for f in sharded.padded_numels()]
            *blocks, root = numels
            gathers = sum(2 * ring(n, 4, world) for n in blocks[:-1]) + ring(blocks[-1], 4, world) + ring(root, 4, world)
            syncs = accum if sync_each and not once else 1
            if shard_states:
                bucket = sharded.ctx.replicated.bucket_numel
                adapter_bytes = syncs * ring(bucket, 4, world) + ring(bucket, 4, world) + 4 * ring(1, 4, world)
            else:
                adapter_bytes = syncs * 2 * ring(n_adapters, 4, world) + 2 * ring(1, 4, world)
            expect = accum * gathers + adapter_bytes
            assert sharded.comm_bytes() - before == expect, (sharded.comm_bytes() - before, expect)
        if shard_states:  # AdamW state for this rank's run only, its step counter (what a checkpoint saves) kept
            assert {id(p) for p in opt.state} == {id(p) for p in stepped}
            assert all(int(st["step"]) == step + 1 for st in opt.state.values())
    for n, p in adapters.items():
        torch.testing.assert_close(p.detach(), ref_adapters[n], rtol=1e-4, atol=1e-6)
        gathered = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered)  # replicated: bit-identical on every rank


def _frozen_units_free_early() -> None:
    """A unit holding only frozen weights is freed as soon as its inputs' gradient exists, not at the end."""
    model = lora_model()
    sharded = shard_model(model, lora_policy(model), device=torch.device("cpu"))
    units = sharded.units[:-1]
    seen: list[list[ShardState]] = []

    def on_grad(_):
        seen.append([u.state for u in units])  # when unit 0's backward starts

    def hook(module, args, out) -> None:
        out.register_hook(on_grad)

    units[0].module.register_forward_hook(hook)
    ids, labels = global_batch(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    (token_loss_sum(model, ids.chunk(world)[rank], labels.chunk(world)[rank]) / num_targets(labels)).backward()
    assert seen and all(s is ShardState.SHARDED for s in seen[0][2:]), seen  # units 2.. already freed
    assert all(u.state is ShardState.SHARDED for u in sharded.units)


def _bf16_base() -> None:
    """bf16 frozen base + fp32 adapters: dtypes as designed, and training follows fp32 LoRA closely."""
    ref_steps, _ = _reference(1)
    model = lora_model()
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # what parallelize does under mixed_precision=bf16 + LoRA
    sharded = shard_model(model, lora_policy(model, param_dtype=torch.bfloat16), device=torch.device("cpu"))
    assert all(f.dtype == torch.bfloat16 for u in sharded.units for f in u.flats)
    opt = adamw(sharded.optimizer_param_groups(0.1))
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    def grads_are_fp32() -> None:
        assert all(p.grad.dtype == torch.float32 for g in opt.param_groups for p in g["params"])

    for step in range(4):
        loss, _ = train_step(model, sharded, opt, step, accum=1, sync_each=True, before_step=grads_are_fp32)
        assert abs(loss - ref_steps[step][0]) <= 2e-2 * abs(ref_steps[step][0]), (step, loss, ref_steps[step][0])


def _peft_final(out_dir: str) -> None:
    """`final/` under LoRA is a PEFT adapter: PeftModel.from_pretrained(base, final) gives the trained logits."""
    model = lora_model()
    sharded = shard_model(model, lora_policy(model), device=torch.device("cpu"))
    opt = adamw(sharded.optimizer_param_groups(0.1))
    for step in range(3):
        train_step(model, sharded, opt, step, accum=1, sync_each=True)
    ids, _ = global_batch(99)
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    out = Path(out_dir) / "final"
    save_final(sharded, model, build_char_tokenizer(), out, is_main=dist.get_rank() == 0)
    dist.barrier()
    if dist.get_rank() == 0:
        assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        loaded = PeftModel.from_pretrained(build_model("tiny-llama"), str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(build_model("tiny-llama")(input_ids=ids).logits, trained)  # it did train


def _all(kind: str, **kw) -> None:
    {"parity": _parity, "early": _frozen_units_free_early, "bf16": _bf16_base, "final": _peft_final}[kind](**kw)


def test_lora_2_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_all, 2, [
            dict(kind="parity", strategy="full_shard", accum=1, sync_each=True),
            dict(kind="parity", strategy="full_shard", accum=2, sync_each=True, once=True),
            dict(kind="parity", strategy="full_shard", accum=2, sync_each=False),
            dict(kind="parity", strategy="no_shard", accum=2, sync_each=False),
            dict(kind="parity", strategy="no_shard", accum=1, sync_each=True, shard_states=False),
            dict(kind="parity", strategy="full_shard", accum=2, sync_each=True, vocab_parallel=False),
            dict(kind="parity", strategy="full_shard", accum=2, sync_each=True, once=True, shard_states=False,
                 vocab_parallel=False),
            dict(kind="early"),
            dict(kind="bf16"),
            dict(kind="final", out_dir=tmp),
        ])


@pytest.mark.timeout(240)  # a rank that skipped a collective would hang the others until gloo's timeout
def test_lora_4_ranks() -> None:
    run_distributed(_all, 4, [dict(kind="parity", strategy="full_shard", accum=1, sync_each=True, once=True,
                                   model_kw=FEW),
                              dict(kind="parity", strategy="full_shard", accum=2, sync_each=False, shard_states=False),
                              dict(kind="parity", strategy="hybrid_shard", accum=1, sync_each=True, shard_states=False),
                              dict(kind="parity", strategy="full_shard", accum=2, sync_each=True, once=True),
                              dict(kind="parity", strategy="hybrid_shard", accum=2, sync_each=True, once=True)])
