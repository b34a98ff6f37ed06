"""`shardtune validate`'s checks beyond the schema: the data as training will read it, the model's limits, the
schedule. Each problem is one line; the command prints them all and exits 2 (a sample of every data file is read,
so a 1 GB file costs what a small one does)."""
from __future__ import annotations

from shardtune.config.schema import Recipe
from shardtune.errors import UserError


def recipe_problems(recipe: Recipe) -> list[str]:
    from shardtune.data.check import data_problems
    from shardtune.model import build_tokenizer, load_config
    from shardtune.moe_checks import model_problems
    from shardtune.trackers import tracker_problems

    t = recipe.train
    problems = tracker_problems(t.report_to)
    if t.max_steps is not None and t.warmup_steps >= t.max_steps:
        problems.append(f"train.warmup_steps={t.warmup_steps} >= train.max_steps={t.max_steps}: the learning rate "
                        "would never leave warmup; lower train.warmup_steps")
    try:
        positions = getattr(load_config(recipe.model), "max_position_embeddings", None)
        if positions is not None and recipe.data.seq_len > positions:
            problems.append(f"data.seq_len={recipe.data.seq_len} exceeds the model's max_position_embeddings="
                            f"{positions}: set data.seq_len <= {positions}")
        problems += model_problems(recipe)
    except UserError as e:
        problems.append(str(e))
    try:
        tok = build_tokenizer(recipe.model)
    except UserError as e:
        return [*problems, str(e)]
    return problems + [line for p in data_problems(recipe.data, tok) for line in p.splitlines()]
