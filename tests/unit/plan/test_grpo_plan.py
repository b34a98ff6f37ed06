"""The plan of a GRPO step (plan/grpo.py), as explicit formulas: its micro-steps are an SFT step over the
completion rows plus the rollouts kept beside them; sampling holds the KV cache of every row. (Agreement with the
simulated step: tests/simulated/test_grpo_plan_simulate.py.)"""
from __future__ import annotations

import dataclasses

from shardtune.config.load import load_recipe
from shardtune.plan import make_plan
from shardtune.plan.estimate import Setup, estimate
from shardtune.plan.stats import ModelStats

RECIPE = "llama-3.2-3b-grpo-lora-1x24gb"
TRAINING = ("forward-loss", "loss-backward", "norm-backward", "unit-backward", "unit-gradcat", "unit-reduce",
            "root-gradcat", "root-reduce", "optimizer")


def test_micro_steps_are_an_sft_step_over_the_completion_rows_plus_the_rollouts() -> None:
    grpo = make_plan(RECIPE)
    # the same model and engine as SFT: 8 rows (1 prompt x 8 completions) of 256 + 512 tokens, one causal call
    # each, the whole logits
    sft_recipe = load_recipe(RECIPE, ["train.objective=sft", "data.format=text", "data.path=builtin:reverse",
                                      "data.packing=false", "train.loss_chunk_tokens=0"])
    s = dataclasses.replace(Setup.from_recipe(sft_recipe, world=1, nodes=1, device_is_cpu=False),
                            micro_batch=8, seq_len=768)
    sft = estimate(ModelStats(sft_recipe), s)
    # each micro-step's rollout: ids [8, 768] int64, the completion mask [8, 767] fp32, the advantages [8]; 8 of them
    rollouts = 8 * (8 * (768 * 8 + 767 * 4 + 4))
    for phase in TRAINING:
        assert grpo.estimate.phases[phase] == sft.phases[phase] + rollouts, phase
    assert grpo.estimate.peak_phase == "loss-backward"


def test_sampling_holds_every_rows_kv_cache() -> None:
    """Each further completion token adds a position to the cache of every layer: 2 (K, V) x 28 layers x 8 rows x
    8 kv heads x 128 x 2 bytes (bf16), plus its int64 mask column (two alive while one grows), drawn token and
    uniform; and the last round's rollouts, alive while sampling, a token longer (int64 id, fp32 mask) in each of
    the 8 rows of the 8 micro-steps."""
    short, longer = (make_plan(RECIPE, [f"grpo.max_new_tokens={n}"]).estimate for n in (512, 576))
    per_token = 2 * 28 * 8 * 8 * 128 * 2 + 8 * (16 + 12) + 8 * 8 * 12
    assert longer.phases["generate"] - short.phases["generate"] == 64 * per_token
    assert "logps" not in short.phases  # beta 0, one pass: no log-probs kept
    kept = make_plan(RECIPE, ["grpo.beta=0.04", "grpo.num_iterations=2"]).estimate
    # both log-probs kept: 2 x [8, 767] fp32 more per micro-step's rollout, 8 micro-steps
    assert kept.phases["loss-backward"] - short.phases["loss-backward"] == 8 * 2 * 8 * 767 * 4
    assert kept.phases["logps"] > 0
