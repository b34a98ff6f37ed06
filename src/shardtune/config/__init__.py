from shardtune.config.load import list_bundled_recipes, load_recipe, resolve_recipe_path, to_yaml
from shardtune.config.schema import Recipe

__all__ = ["Recipe", "load_recipe", "resolve_recipe_path", "list_bundled_recipes", "to_yaml"]
