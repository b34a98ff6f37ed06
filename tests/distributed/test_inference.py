"""eval / no_grad / generate through the engine give what the unsharded model gives, and training still works
after them (the leftover state of an inference forward must not leak into the next step)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.common import MODELS, adamw, build_model, global_batch, policy_for, train_step
from tests.distributed.harness import grid, run_distributed

from shardtune.engine.shard import shard_model
from shardtune.engine.unit import ShardState


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


def test_inference_matches_unsharded_2_ranks() -> None:
    run_distributed(_inference, 2, grid(model_name=list(MODELS), strategy=["full_shard", "shard_grad_op"],
                                        param_dtype=[torch.float32]) +
                    grid(model_name=["tiny-llama"], strategy=["no_shard", "full_shard"],
                         param_dtype=[torch.bfloat16]))
