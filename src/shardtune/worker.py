"""Worker entry point: `python -m shardtune.worker RESOLVED_RECIPE.yaml` (what torchrun starts)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from shardtune.config.load import load_recipe
from shardtune.config.schema import Recipe
from shardtune.errors import UserError


def run_worker(recipe: Recipe) -> int:
    from shardtune.train import train

    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    try:
        train(recipe)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        err = Path(recipe.train.output_dir) / ".user_error"
        try:
            err.parent.mkdir(parents=True, exist_ok=True)
            err.write_text(str(e))
        except OSError:
            pass
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m shardtune.worker RECIPE.yaml", file=sys.stderr)
        sys.exit(2)
    try:
        recipe = load_recipe(sys.argv[1])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(recipe))


if __name__ == "__main__":
    main()
