"""Issue-13 correctness traps, one spawn per world size:
- random init drawn shard by shard: the same weights at world 1, 2 and 4 as the whole-model init, and a rank's peak
  while building stays at its shards + one unit (never the model); FSDP2 (engine.backend=torch) too, random and
  pretrained;
- a rank whose initial weights differ (its own init, another seed, other checkpoint files) is a clear error on
  every rank (start-up checksum), not a hang;
- resume under CPU offload with replicas (no_shard, hybrid 2x2) is exact and sends no engine state through a
  collective (on NCCL a host tensor cannot be sent);
- sharded generation where ranks stop at different steps finishes (synced_gpus), both backends, and equals
  single-process generation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from tests.distributed.common import (
    adamw,
    build_model,
    global_batch,
    nf4_chunks_relative,
    policy_for,
    train_step,
)
from tests.distributed.harness import run_distributed
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.checkpoint.manager import CheckpointManager, load
from shardtune.config.load import load_recipe
from shardtune.engine.shard import shard_model
from shardtune.errors import UserError
from shardtune.memory import CpuMemoryTracker
from shardtune.model.build import build_model as build_recipe_model
from shardtune.model.fingerprint import MIN_CHUNK
from shardtune.model.loading import build_empty, checkpoint_key, load_into_shards
from shardtune.trainer.decode import greedy_decode
from shardtune.trainer.parallelize import parallelize

CPU = torch.device("cpu")


# -- random init, sharded ---------------------------------------------------------------------------------------------
def _sharded_init(lora: bool) -> None:
    """Gathered weights == the whole-model init (bit-exact); peak while building <= shards + one unit."""
    overrides = ["lora.enabled=true", "engine.mixed_precision=bf16"] if lora else []
    recipe = load_recipe("tiny-cpu", overrides)
    reference = dict(build_recipe_model(recipe.model, seed=recipe.train.seed).named_parameters())
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    model = build_recipe_model(recipe.model, seed=recipe.train.seed, sharded_init=True)
    assert all(p.is_meta for p in model.parameters())
    sharded = parallelize(model, recipe, device=CPU, world_size=dist.get_world_size())
    peak = tracker.peak_bytes() - base
    tracker.stop()
    flats = [f for u in sharded.units for f in u.flats]
    shards = sum(f.shard.nbytes for f in flats)
    largest_unit = max(sum(f.padded_numel for f in u.flats) for u in sharded.units) * 4  # drawn in fp32
    buffers = sum(b.nbytes for b in model.buffers())
    adapters = sum(p.nbytes for p in model.parameters() if p.requires_grad) if lora else 0
    scratch = 2 * 8 * MIN_CHUNK  # the checksum's int64 scratch (fingerprint.py)
    assert peak <= shards + largest_unit + buffers + adapters + scratch, (peak, shards, largest_unit)
    model_bytes = sum(p.nbytes for p in reference.values())
    assert shards + largest_unit + scratch < model_bytes + shards  # the bound excludes a whole-model build
    full = dict(sharded.full_state_dict())
    if dist.get_rank() == 0:
        base_names = {checkpoint_key(n): t for n, t in full.items()}  # the LoRA base keeps the plain model's values
        assert set(base_names) == set(reference), sorted(set(base_names) ^ set(reference))[:4]
        for name, t in base_names.items():
            expected = reference[name].detach().to(t.dtype)
            assert torch.equal(t, expected), name


# -- FSDP2's init, sharded ---------------------------------------------------------------------------------------------
def _fsdp2_recipe_and_whole(root: str, pretrained: bool, name: str, *, seed: int,
                            extra: tuple[str, ...] = ()) -> tuple:
    """tiny-cpu on FSDP2 (random, or a checkpoint of several files written to `root`/`name`), and its whole model."""
    overrides = ["engine.backend=torch", *extra]
    if pretrained:
        path = Path(root) / name
        if dist.get_rank() == 0:
            build_model("tiny-llama", seed=seed).save_pretrained(path, max_shard_size="300KB")
        dist.barrier()
        overrides += ["model.init=pretrained", f"model.path={path}", "model.config=null"]
    recipe = load_recipe("tiny-cpu", overrides)
    whole = (AutoModelForCausalLM.from_pretrained(recipe.model.path) if pretrained
             else build_recipe_model(recipe.model, seed=recipe.train.seed))
    return recipe, whole


def _fsdp2_init(root: str, pretrained: bool) -> None:
    """engine.backend=torch: fully_shard on meta, then each rank makes only its own chunks (engine/fsdp2_init.py).
    The gathered weights equal the whole-model init, or the checkpoint (several files), bit for bit; a rank's peak
    while building is its chunks plus one module, never the model (FSDP2's load of the whole model was)."""
    recipe, whole = _fsdp2_recipe_and_whole(root, pretrained, "fsdp2-checkpoint", seed=3)
    reference = dict(whole.named_parameters())
    largest_module = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in whole.modules())
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    model = build_recipe_model(recipe.model, seed=recipe.train.seed, sharded_init=True)
    sharded = parallelize(model, recipe, device=CPU, world_size=dist.get_world_size())
    peak = tracker.peak_bytes() - base
    tracker.stop()
    model_bytes = sum(t.nbytes for t in reference.values())
    buffers = sum(b.nbytes for b in model.buffers())
    assert peak <= model_bytes // dist.get_world_size() + largest_module + buffers + (64 << 10), (peak, model_bytes)
    full = dict(sharded.full_state_dict())
    if dist.get_rank() == 0:
        assert set(full) == set(reference), sorted(set(full) ^ set(reference))[:4]
        for name, t in full.items():
            assert torch.equal(t, reference[name].detach()), name


def _fsdp2_qlora_init(root: str, pretrained: bool) -> None:
    """QLoRA on FSDP2: torchao quantizes whole weights before fully_shard, so each unit's quantized weights are made
    (read or drawn, one weight at a time) just before FSDP2 shards that unit (engine/fsdp2_init.py
    quantized_weights_maker), the rest as a rank's rows after. The NF4 weights gathered equal those of the whole
    model quantized, bit for bit (every part); while building, a rank holds what it keeps plus one unit, never the
    model (the whole-model load, before: its peak was the whole model in fp32)."""
    recipe, whole = _fsdp2_recipe_and_whole(root, pretrained, "fsdp2-qlora-checkpoint", seed=4,
                                            extra=("lora.enabled=true", "lora.quantize_base=nf4"))
    # The reference: the whole model made first (the old path), then quantized and sharded.
    parallelize(whole, recipe, device=CPU, world_size=dist.get_world_size())
    reference = _local_parts(whole)
    del whole
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    model = build_recipe_model(recipe.model, seed=recipe.train.seed, sharded_init=True)
    unit_bytes = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers)
    largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    with nf4_chunks_relative():
        sharded = parallelize(model, recipe, device=CPU, world_size=dist.get_world_size())
    kept = tracker.live_bytes() - base
    peak = tracker.peak_bytes() - base
    tracker.stop()
    # beyond what it keeps: one unit (fp32, an upper bound of its NF4 weights) and one module's transients
    assert peak - kept <= unit_bytes + 3 * largest_module, (peak, kept, unit_bytes, largest_module, model_bytes)
    got = _local_parts(sharded.module)
    # what it keeps is its chunks (an NF4 chunk must not hold its whole weight's bytes alive: views of one region did)
    held = sum(t.nbytes for t in got.values()) + sum(b.nbytes for b in sharded.module.buffers())
    assert kept <= held + (16 << 10), (kept, held)
    assert set(got) == set(reference) and any(k.endswith(".quantized_data") for k in got), sorted(got)[:6]
    for name, t in got.items():  # the adapters: drawn by peft on a whole model, seeded on a meta one (not compared)
        assert "lora_" in name or torch.equal(t, reference[name]), name


def _local_parts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's chunk of every parameter (an NF4 weight's as each of its parts): name -> tensor."""
    out = {}
    for name, p in model.named_parameters():
        local = p.detach().to_local()
        parts = getattr(local, "__tensor_flatten__", None)
        for part in parts()[0] if parts is not None else ():
            out[f"{name}.{part}"] = getattr(local, part)
        if parts is None:
            out[name] = local
    return out


# -- bf16 masters -----------------------------------------------------------------------------------------------------
def _bf16_masters() -> None:
    """The engine refuses 16-bit trainable shards (they are the AdamW masters); a bf16 LoRA base is fine and its
    adapters, the only trainable tensors, are stepped in fp32."""
    model = build_model("tiny-llama").to(torch.bfloat16)
    with pytest.raises(UserError, match="master weights"):
        shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()), device=CPU)
    recipe = load_recipe("tiny-cpu", ["model.dtype=bf16", "lora.enabled=true"])
    model = build_recipe_model(recipe.model, seed=0, sharded_init=True)
    sharded = parallelize(model, recipe, device=CPU, world_size=dist.get_world_size())
    params = [p for g in sharded.optimizer_param_groups(0.0) for p in g["params"]]
    assert params and all(p.dtype == torch.float32 for p in params)
    assert {f.dtype for u in sharded.units for f in u.flats} == {torch.bfloat16}  # the frozen base


# -- start-up checksum ------------------------------------------------------------------------------------------------
def _mismatch(root: str) -> None:
    model = build_model("tiny-llama")
    if dist.get_rank() == 1:  # one rank's init differs by one element of one unit
        with torch.no_grad():
            model.model.layers[2].mlp.up_proj.weight[3, 5] += 1e-3
    with pytest.raises(UserError, match=r"model\.layers\.2.*rank\(s\) \[1\]"):
        shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()), device=CPU)
    # The sharded init: a rank with another seed is caught at its first unit.
    recipe = load_recipe("tiny-cpu", [f"train.seed={dist.get_rank()}"])
    meta = build_recipe_model(recipe.model, seed=recipe.train.seed, sharded_init=True)
    with pytest.raises(UserError, match=r"model\.layers\.0'.*differ"):
        parallelize(meta, recipe, device=CPU, world_size=dist.get_world_size())
    # Pretrained: a rank whose model.path holds another checkpoint of the same architecture (another node's copy of
    # a fine-tune of it: its norms moved).
    paths = [Path(root) / name for name in ("base", "tuned")]
    if dist.get_rank() == 0:
        model = build_model("tiny-llama", seed=3)
        model.save_pretrained(paths[0])
        with torch.no_grad():
            model.model.layers[1].post_attention_layernorm.weight.mul_(1.01)
        model.save_pretrained(paths[1])
    dist.barrier()
    for mine, match in ((paths[dist.get_rank()], r"model\.path.*differ"), (paths[0], None)):
        model = build_empty(lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths[0])))
        sharded = shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()), device=CPU)
        flats = [f for u in sharded.units for f in u.flats]
        with pytest.raises(UserError, match=match) if match else contextlib.nullcontext():
            load_into_shards(flats, model, mine)
    # Equal builds pass (the check is not a blanket failure), and the check leaves no bytes behind even while its
    # collective's tensors are still referenced: gloo's worker thread lets go of a finished work only some time after
    # wait() returned (this made the exact byte counts of test_accounting/test_loading flaky under load).
    held: list[torch.Tensor] = []
    real_all_gather = dist.all_gather

    def holding(out, t, *args, **kwargs):
        held.extend([t, *out])
        return real_all_gather(out, t, *args, **kwargs)

    model = build_model("tiny-llama")
    with mock.patch.object(dist, "all_gather", holding):
        shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()), device=CPU)
    assert held and all(t.untyped_storage().nbytes() == 0 for t in held)


# -- resume under offload with replicas -------------------------------------------------------------------------------
def _scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    """A real LambdaLR over a one-parameter optimizer: a load restores the schedule's step counter into it
    (checkpoint/manager.py restore_schedule_step), which a stand-in without base_lrs and lr_lambdas cannot take."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "scatter", "gather", "send", "recv", "isend", "irecv", "reduce")


@contextlib.contextmanager
def recording_collectives():
    """Record every tensor handed to a torch.distributed collective (the module functions DCP and we call)."""
    seen: list[tuple[str, torch.Tensor]] = []
    saved = {}

    def wrap(name, fn):
        def recorder(*args, **kwargs):
            for a in [*args, *kwargs.values()]:
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        seen.append((name, t))
            return fn(*args, **kwargs)
        return recorder

    for name in COLLECTIVES:
        for mod in (dist, c10d):
            saved[mod, name] = getattr(mod, name)
            setattr(mod, name, wrap(name, saved[mod, name]))
    try:
        yield seen
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def _resume(strategy: str, root: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()

    def make():
        model = build_model("tiny-llama")
        policy = dataclasses.replace(policy_for(model, strategy, world=world), cpu_offload=True)
        sharded = shard_model(model, policy, device=CPU)
        return model, sharded, adamw(sharded.optimizer_param_groups(0.1))

    model, sharded, opt = make()
    for step in range(2):
        train_step(model, sharded, opt, step, accum=2, sync_each=True)
    path = Path(root) / strategy
    CheckpointManager(path, keep_last=0, is_main=rank == 0, rank=rank).save(
        2, sharded.checkpoint_state(opt), _scheduler(), {"world_size": world})
    saved_shards = [f.shard.clone() for u in sharded.units for f in u.flats]
    expected = [train_step(model, sharded, opt, step, accum=2, sync_each=True) for step in (2, 3)]

    model, sharded, opt = make()  # fresh: step-0 weights, empty AdamW state
    host_state = {f.shard.untyped_storage().data_ptr() for u in sharded.units for f in u.flats}
    state = sharded.checkpoint_state(opt, for_load=True)  # creates AdamW's state tensors, loaded in place
    host_state |= {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if t.ndim}
    with recording_collectives() as seen:
        assert load(path / "checkpoints" / "step_2", state, _scheduler(), rank=rank, world_size=world) == 2
        sharded.load_checkpoint_state(state, opt)
    # Engine state lives on the host under offload: none of it may go through a (device) collective; what DCP
    # sends (plans, metadata) is on the group's device (CPU for gloo).
    sent_state = [name for name, t in seen if t.untyped_storage().data_ptr() in host_state]
    assert not sent_state, sent_state
    assert all(t.device == CPU for _, t in seen)
    for before, f in zip(saved_shards, [f for u in sharded.units for f in u.flats], strict=True):
        assert torch.equal(before, f.shard)  # every replica read its own chunks
    got = [train_step(model, sharded, opt, step, accum=2, sync_each=True) for step in (2, 3)]
    assert [(loss, float(n)) for loss, n in got] == [(loss, float(n)) for loss, n in expected]


# -- generation with ranks stopping at different steps ----------------------------------------------------------------
def _generate(backend: str) -> None:
    from shardtune.engine import torch_backend

    rank = dist.get_rank()
    ref = build_model("tiny-llama").eval()
    model = build_model("tiny-llama").eval()
    policy = policy_for(model, "full_shard", world=dist.get_world_size())
    (shard_model if backend == "shardtune" else torch_backend.shard_model)(model, policy, device=CPU)
    ids, _ = global_batch(0)
    prompt = ids[2 * rank:2 * rank + 2, :5]  # each rank its own prompts...
    new_tokens = 3 + 5 * rank  # ...and its own stop: rank 0 stops 5 tokens before rank 1
    out = greedy_decode(model, prompt, max_new_tokens=new_tokens, pad_token_id=0, world_size=dist.get_world_size())
    expected = ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 5 + new_tokens) and torch.equal(out, expected), (out, expected)


def _all(kind: str, **kw) -> None:
    {"init": _sharded_init, "mismatch": _mismatch, "resume": _resume, "generate": _generate,
     "bf16": _bf16_masters, "fsdp2_init": _fsdp2_init, "fsdp2_qlora_init": _fsdp2_qlora_init}[kind](**kw)


def test_traps_1_rank() -> None:
    run_distributed(_all, 1, [dict(kind="init", lora=False), dict(kind="bf16")])


def test_traps_2_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_all, 2, [dict(kind="init", lora=False), dict(kind="init", lora=True),
                                  dict(kind="mismatch", root=tmp), dict(kind="resume", strategy="no_shard", root=tmp),
                                  dict(kind="generate", backend="shardtune"), dict(kind="generate", backend="torch"),
                                  dict(kind="fsdp2_init", root=tmp, pretrained=False),
                                  dict(kind="fsdp2_init", root=tmp, pretrained=True),
                                  dict(kind="fsdp2_qlora_init", root=tmp, pretrained=False),
                                  dict(kind="fsdp2_qlora_init", root=tmp, pretrained=True)],
                        timeout_s=60)


def test_traps_4_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_all, 4, [dict(kind="init", lora=False), dict(kind="resume", strategy="hybrid_shard", root=tmp)])
