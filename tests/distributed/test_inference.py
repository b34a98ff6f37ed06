"""eval / no_grad / generate through the engine give what the unsharded model gives, and training still works
after them (the leftover state of an inference forward must not leak into the next step)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.common import MODELS, adamw, build_model, global_batch, policy_for, train_step
from tests.distributed.harness import grid, run_distributed

from shardtune.engine.shard import shard_model
from shardtune.engine.unit import ShardState
from shardtune.memory import CpuMemoryTracker


def _inference(model_name: str, strategy: str, param_dtype: torch.dtype) -> None:
    ref = build_model(model_name).eval()
    model = build_model(model_name).eval()
    sharded = shard_model(model, policy_for(model, strategy, world=dist.get_world_size(), param_dtype=param_dtype),
                          device=torch.device("cpu"))
    for p in ref.parameters():  # like the engine's mixed precision: params in param_dtype, buffers (RoPE) as built
        p.data = p.data.to(param_dtype)
    ids, _ = global_batch(0)
    prompt = ids[:2, :6]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert all(u.state is ShardState.SHARDED for u in sharded.units)  # no_grad frees every unit, root included
    gen = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref_gen = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen), (gen, ref_gen)
    assert gen.shape == (2, 14)
    assert all(u.state is ShardState.SHARDED for u in sharded.units)
    # eval forward with grad enabled and no backward (leaves the root and last unit gathered) then training
    model(input_ids=ids)
    model.train()
    opt = adamw(sharded.optimizer_param_groups(0.1))
    loss, _ = train_step(model, sharded, opt, 0, accum=1, sync_each=True)
    assert torch.isfinite(torch.tensor(loss))
    assert all(u.state is ShardState.SHARDED for u in sharded.units)  # everything resharded after backward


def _full_state_dict(model_name: str, strategy: str) -> None:
    """Every original parameter, full and exact, on rank 0 only; rank 0 holds at most the yielded tensor plus one
    gathered flat buffer beyond what it keeps."""
    ref = build_model(model_name)
    model = build_model(model_name)
    sharded = shard_model(model, policy_for(model, strategy, world=dist.get_world_size()), device=torch.device("cpu"))
    largest = max(f.padded_numel * f.shard.element_size() for u in sharded.units for f in u.flats)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    got = {}
    for name, t in sharded.full_state_dict():
        got[name] = (t.sum().item(), t.shape, torch.equal(t, dict(ref.named_parameters())[name].detach()))
        del t  # a writer would stream it to disk here
        assert tracker.live_bytes() - base <= largest
    peak = tracker.peak_bytes() - base
    tracker.stop()
    if dist.get_rank() == 0:
        assert set(got) == {n for n, _ in ref.named_parameters()}  # tied weights once, as in named_parameters()
        assert all(eq for _, _, eq in got.values())
        assert peak <= 2 * largest, (peak, largest)
    else:
        assert got == {}


def _run(kind: str, **kw) -> None:
    (_inference if kind == "inference" else _full_state_dict)(**kw)


def test_inference_and_full_state_dict_2_ranks() -> None:
    settings = (grid(model_name=list(MODELS), strategy=["full_shard", "shard_grad_op"], param_dtype=[torch.float32])
                + grid(model_name=["tiny-llama"], strategy=["no_shard", "full_shard"], param_dtype=[torch.bfloat16]))
    settings = [dict(kind="inference", **s) for s in settings]
    settings += [dict(kind="state_dict", model_name=m, strategy="full_shard") for m in MODELS]
    run_distributed(_run, 2, settings)
