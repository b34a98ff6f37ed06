"""Limits of the model that the recipe must respect, checked alike by `validate`, `plan`, `prepare` and `train`'s
launcher before anything heavy starts. Torch-free: read from config.json (plan/arch.py)."""
from __future__ import annotations

from shardtune.config.schema import Recipe
from shardtune.errors import UserError


def seq_len_problem(recipe: Recipe) -> str | None:
    """data.seq_len over the model's max_position_embeddings: positions the model was never built for (rotary
    embeddings past their range, or an index error in a learned position table)."""
    from shardtune.plan.arch import read_config_json

    raw = read_config_json(recipe.model) or {}
    positions = raw.get("max_position_embeddings")
    if isinstance(positions, int) and recipe.data.seq_len > positions:
        return (f"data.seq_len={recipe.data.seq_len} exceeds the model's max_position_embeddings={positions}: set "
                f"data.seq_len <= {positions}")
    return None


def check_model_limits(recipe: Recipe) -> None:
    problem = seq_len_problem(recipe)
    if problem:
        raise UserError(problem)
