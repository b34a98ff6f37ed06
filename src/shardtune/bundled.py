"""Where the bundled recipes and configs are. Torch-free: the launcher and `shardtune recipes` import it.

They live once in the repository, at its top level (`recipes/`, `configs/`). A built wheel carries them inside
the package (`shardtune/recipes`, `shardtune/configs`: setup.py maps the folders there at build time), so an
installed shardtune finds them by the same bundled names with no repository around it.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir() -> Path:
    if (PACKAGE_DIR / "recipes").is_dir():  # a wheel (non-editable install)
        return PACKAGE_DIR
    return PACKAGE_DIR.parent.parent  # a source checkout: src/shardtune -> the repository root


DATA_DIR = _data_dir()  # holds recipes/ and configs/; relative paths in recipes resolve against it last
RECIPES_DIR = DATA_DIR / "recipes"
CONFIGS_DIR = DATA_DIR / "configs"
