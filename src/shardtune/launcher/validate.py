"""`shardtune validate`'s checks beyond the schema: the data as training will read it, the model's limits, the
schedule. Each problem is one line; the command prints them all and exits 2 (a sample of every data file is read,
so a 1 GB file costs what a small one does)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.config.schema import ModelConfig, Recipe
from shardtune.errors import UserError
from shardtune.startup import imports_without_gc

if TYPE_CHECKING:  # the launcher loads transformers only when validate builds the model
    from transformers import PretrainedConfig


def recipe_problems(recipe: Recipe) -> list[str]:
    with imports_without_gc():
        from shardtune.data.check import data_problems
        from shardtune.model.build import build_tokenizer, check_vocab, load_config
        from shardtune.model.moe_checks import model_problems
        from shardtune.plan.model_limits import seq_len_problem
        from shardtune.trainer.trackers import tracker_problems

    t = recipe.train
    problems = tracker_problems(t.report_to)
    if t.max_steps is not None and t.warmup_steps >= t.max_steps:
        problems.append(f"train.warmup_steps={t.warmup_steps} >= train.max_steps={t.max_steps}: the learning rate "
                        "would never leave warmup; lower train.warmup_steps")
    problems += [p for p in [seq_len_problem(recipe)] if p]
    hf_config = None
    try:
        hf_config = build_on_meta(recipe.model)
        problems += model_problems(recipe)
    except UserError as e:
        problems.append(str(e))
    try:
        tok = build_tokenizer(recipe.model)
    except UserError as e:
        return [*problems, str(e)]
    try:
        check_vocab(tok, hf_config or load_config(recipe.model), recipe.model)  # read once when the build got it
    except UserError as e:
        if str(e) not in problems:  # an unreadable config: the build above said so already
            problems.append(str(e))
    return problems + [line for p in data_problems(recipe.data, tok) for line in p.splitlines()]


def build_on_meta(cfg: ModelConfig) -> PretrainedConfig:
    """Build the model as training will, on the meta device (no memory, ~1 s beyond the imports): a config
    transformers reads but cannot build from fails here, as one line, not in every rank."""
    import torch

    from shardtune.config.dtypes import DTYPES
    from shardtune.hub import is_hub_id
    from shardtune.model.build import config_source, from_config, load_config
    from shardtune.model.loading import check_checkpoint_shapes

    hf_config = load_config(cfg)
    with torch.device("meta"):
        model = from_config(cfg, hf_config, dtype=DTYPES[cfg.dtype])
    if cfg.init == "pretrained" and not is_hub_id(cfg.path):  # a hub id's weights are the trainer's to fetch
        check_checkpoint_shapes(model, Path(cfg.path), config_source(cfg))
    return hf_config
