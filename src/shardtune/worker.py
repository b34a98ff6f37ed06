"""Worker entry point: `python -m shardtune.worker RESOLVED_RECIPE.yaml` (what torchrun starts)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from shardtune.config.load import load_recipe
from shardtune.config.schema import Recipe
from shardtune.errors import UserError


def run_worker(recipe: Recipe, error_file: Path | None = None) -> int:
    """Train; a user error is printed (one line), or written to `error_file` when the launcher will print it."""
    from shardtune.train import TrainingStopped, train

    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    try:
        train(recipe)
    except TrainingStopped as e:  # preempted (checkpoint saved) or diverged: a message, a documented code
        import torch.distributed as dist

        if error_file is None:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"shardtune: {e}", file=sys.stderr, flush=True)
        else:  # the launcher prints it once and exits with this code (torchrun alone would say 1)
            error_file.with_name(".exit_code").write_text(f"{e.code}\n{e}")
        return e.code
    except UserError as e:
        if error_file is None:
            print(f"error: {e}", file=sys.stderr)
        else:
            error_file.write_text(str(e))
        return 2
    finally:
        _release_process_groups()
    return 0


def _release_process_groups() -> None:
    """Destroy the process groups and free them now. `destroy_process_group` only drops torch's own references;
    the sharded model (a reference cycle) still holds its groups, and a gloo group left for interpreter teardown
    can have its worker threads destroyed unjoined: SIGABRT, "terminate called without an active exception",
    after a run that had succeeded (seen once in CI; 50 loaded runs here did not reproduce it)."""
    import gc

    import torch.distributed as dist

    from shardtune import accelerator

    if dist.is_initialized():
        dist.destroy_process_group()
    accelerator.forget_host_group()  # its reference would keep the gloo group (and its threads) alive
    gc.collect()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shardtune.worker")
    parser.add_argument("recipe", help="the resolved recipe.yaml the launcher wrote")
    parser.add_argument("--error-file", type=Path, default=None, help="write a user error here instead of stderr")
    args = parser.parse_args()
    try:
        recipe = load_recipe(args.recipe)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(recipe, args.error_file))


if __name__ == "__main__":
    main()
