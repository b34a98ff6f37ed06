"""The `shardtune` command. Each command is a thin layer over a module; errors become one line + exit 2."""
from __future__ import annotations

import sys

import typer

from shardtune.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Config-driven LLM fine-tuning with its own FSDP engine.")

RECIPE = typer.Argument(..., help="A recipe YAML path or the name of a bundled recipe (see `shardtune recipes`).")
OVERRIDES = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.lr=1e-4 engine.strategy=no_shard.")


@app.command()
def train(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES) -> None:
    """Train: starts launch.nproc_per_node workers via torchrun (or runs as one inside torchrun/srun)."""
    from shardtune.config.load import load_recipe_config
    from shardtune.launch import launch_train

    cfg = load_recipe_config(recipe, overrides or [])
    raise typer.Exit(launch_train(cfg))


@app.command()
def validate(recipe: str = RECIPE, overrides: list[str] | None = OVERRIDES) -> None:
    """Check a recipe (schema, values, files, sharding vs world size) without building anything heavy."""
    from shardtune.config.load import load_recipe
    from shardtune.launch import check_launch

    r = load_recipe(recipe, overrides or [])
    nproc = check_launch(r)
    typer.echo(f"ok: {recipe} ({nproc} worker(s) per node x {r.launch.nnodes} node(s), "
               f"engine={r.engine.backend}/{r.engine.strategy}, output_dir={r.train.output_dir})")


@app.command()
def recipes() -> None:
    """List the bundled recipes with their one-line descriptions."""
    from shardtune.config.load import RECIPES_DIR, bundled_description, list_bundled_recipes

    for name, path in list_bundled_recipes().items():
        typer.echo(f"{name:<36} {bundled_description(path)}  [{path.relative_to(RECIPES_DIR)}]")


def main() -> None:
    try:
        code = app(standalone_mode=False)  # click returns (not raises) the exit code in this mode
        sys.exit(code if isinstance(code, int) else 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors arrive here with standalone_mode=False
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        raise
