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
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


def recipe_problems(recipe: Recipe, notes: list[str] | None = None) -> list[str]:
    """Every problem, one line each; `notes` (when given) gets what is worth saying about a valid recipe."""
    with imports_without_gc():
        from shardtune.data.check import data_problems
        from shardtune.model.build import build_tokenizer, check_vocab, load_config
        from shardtune.model.lora import rehearse_lora
        from shardtune.model.moe_checks import model_problems
        from shardtune.plan.model_limits import seq_len_problem
        from shardtune.trainer.rewards import reward_problem
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
        if recipe.lora.enabled and not problems:
            rehearse_lora(recipe)
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
    problems += [line for p in data_problems(recipe.data, tok) for line in p.splitlines()]
    problems += [p for p in [reward_problem(recipe)] if p]
    if notes is not None and not problems:
        notes += [n for n in [cached_data_passes(recipe, tok)] if n]
    return problems


def cached_data_passes(recipe: Recipe, tok: PreTrainedTokenizerBase) -> str | None:
    """trainer/data_passes.py's line, when the data cache (`shardtune prepare`, or an earlier run) already counts
    this data's training rows: validate reads only the head of the data, so without a cache it cannot say."""
    from shardtune.config.schema import data_parallel_size
    from shardtune.data import cache
    from shardtune.data.sources import is_mix
    from shardtune.launcher.launch import workers_per_node
    from shardtune.trainer.data_passes import repeat_notice

    t, d = recipe.train, recipe.data
    if t.max_steps is None or is_mix(d):  # train.epochs sizes the run in passes already; a mix: per dataset
        return None
    manifest = cache.read_manifest(cache.cache_root(d, t.output_dir) / cache.cache_key(d, tok, t.seed))
    if manifest is None:
        return None
    train = manifest["stats"]["train"]
    nproc = workers_per_node(recipe)
    world = data_parallel_size(recipe, nproc * recipe.launch.nnodes, nproc)
    return repeat_notice(num_rows=train.get("pairs", train["rows"]), steps=t.max_steps,  # DPO counts pairs
                         global_size=t.micro_batch_size * t.grad_accum * world)


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
