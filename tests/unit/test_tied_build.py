"""A model whose config ties the embedding and the head (tie_word_embeddings: Llama-3.2-1B, Qwen2.5 up to 3B, Gemma)
is built tied on every path the product takes: on meta (filled by parallelize, pretrained or drawn shard by shard),
and whole (random init). The meta build goes through accelerate, which untied them."""
from __future__ import annotations

import pytest
import torch

from shardtune.config.load import load_recipe
from shardtune.model.build import build_model


@pytest.mark.parametrize("sharded_init", [True, False])
@pytest.mark.parametrize(("config", "tied"), [("tiny-qwen2", True), ("tiny-llama", False)])
def test_the_built_model_ties_as_its_config_says(config: str, tied: bool, sharded_init: bool) -> None:
    recipe = load_recipe("tiny-cpu", [f"model.config=configs/models/{config}.json"])
    model = build_model(recipe.model, seed=0, sharded_init=sharded_init)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (emb is head) == tied
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) != tied  # what the engine shards, saves and loads: one table when tied
    if not sharded_init and tied:
        torch.testing.assert_close(emb, head, rtol=0, atol=0)
