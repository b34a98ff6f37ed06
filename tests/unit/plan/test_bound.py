"""The pre-flight's torch-free bound (plan/bound.py) is >= the plan's peak, so skipping the plan under it is safe."""
from __future__ import annotations

import itertools

import pytest
import torch

from shardtune.config.load import list_bundled_recipes, load_recipe
from shardtune.plan import plan_recipe
from shardtune.plan.arch import config_namespace, read_config_json
from shardtune.plan.bound import param_upper_bound, peak_upper_bound
from shardtune.plan.planner import variant

# Each architecture shape once (tied + biased Qwen2, GQA Llama, Mistral); the 70B-405B ones only add layers and
# cost seconds each in layouts.
CASES = [("tiny-cpu", []), ("tiny-cpu", ["model.config=configs/models/tiny-qwen2.json"]), ("tiny-lora-cpu", []),
         ("mistral-7b-lora-2x24gb", []), ("llama-3.1-8b-full-8x80gb", [])]


def test_cases_are_bundled_recipes() -> None:
    assert {name for name, _ in CASES} <= set(list_bundled_recipes())


@pytest.mark.parametrize(("name", "extra"), CASES)
def test_bound_is_above_every_plan_variant(name: str, extra: list[str]) -> None:
    for mb, seq, attn in [(1, 512, "sdpa"), (4, 2048, "sdpa"), (2, 1024, "eager")]:
        recipe = load_recipe(name, [f"train.micro_batch_size={mb}", f"data.seq_len={seq}",
                                    f"model.attn_implementation={attn}", "train.grad_accum=1", *extra])
        bound = peak_upper_bound(recipe, ranks_per_node=1)
        assert bound is not None
        base = plan_recipe(recipe, with_advice=False)
        assert param_upper_bound(config_namespace(read_config_json(recipe.model))) >= base.stats.num_params
        worst = 0
        for strategy, compute, lora, ck, world in itertools.product(
                ("full_shard", "shard_grad_op", "no_shard"), (torch.float32, torch.bfloat16), (False, True),
                (False, True), (1, 8)):
            p = variant(base, strategy=strategy, compute=compute, lora=lora, checkpointing=ck, world=world, nodes=1,
                        hybrid_shard_size=None, offload=False)
            worst = max(worst, p.estimate.total)
        assert bound.device_bytes >= worst, (name, mb, seq, attn)
        assert bound.device_bytes < 8 * worst  # a bound, but not a useless one
