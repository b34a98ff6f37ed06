from shardtune.config.load import load_recipe, resolve_recipe_path, list_bundled_recipes, to_yaml
from shardtune.config.schema import Recipe

__all__ = ["Recipe", "load_recipe", "resolve_recipe_path", "list_bundled_recipes", "to_yaml"]
