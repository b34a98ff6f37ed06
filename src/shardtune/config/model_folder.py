"""`model.path=DIR` makes DIR the model: its config.json and its tokenizer, not the recipe's.

A recipe such as `tiny-cpu` names `model.config` (architecture) and `model.tokenizer` (builtin:char). A user who
points `model.path` at their own checkpoint on the command line means that checkpoint, so the recipe's two keys
yield to the folder, unless the command line names them too. One line on stderr says which one wins.
"""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from shardtune.errors import UserError
from shardtune.hub import CONFIG, is_hub_id, model_dir

# Any of these in a folder means it carries its own tokenizer (fast, sentencepiece or GPT-2-style files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def override_keys(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in overrides if "=" in o}


def apply_model_folder(cfg: DictConfig, overrides: list[str]) -> None:
    """Runs on the merged, path-resolved recipe (in place)."""
    path = OmegaConf.select(cfg, "model.path")
    if path is None:
        return
    hub = is_hub_id(path)  # a Hub repo: its config.json only here (plan needs no more); a repo has its tokenizer
    folder = model_dir(str(path), CONFIG) if hub else Path(str(path))
    given = override_keys(overrides)
    from_cli = "model.path" in given
    has_config = (folder / "config.json").is_file()
    config = OmegaConf.select(cfg, "model.config")
    if from_cli and config is not None and "model.config" not in given:
        _require_config(path, has_config)
        _notice(f"model.path={path} brings its own config.json: it wins over the recipe's model.config={config} "
                "(give model.config=... on the command line to keep that one)")
        OmegaConf.update(cfg, "model.config", None)
        config = None
    if config is None:
        _require_config(path, has_config)
    tokenizer = OmegaConf.select(cfg, "model.tokenizer")
    if from_cli and tokenizer is not None and "model.tokenizer" not in given:
        if hub or any((folder / f).is_file() for f in TOKENIZER_FILES):
            _notice(f"model.path={path} brings its own tokenizer: it wins over the recipe's "
                    f"model.tokenizer={tokenizer} (give model.tokenizer=... on the command line to keep that one)")
            OmegaConf.update(cfg, "model.tokenizer", None)


def _require_config(path: str, has_config: bool) -> None:
    if not has_config:
        raise UserError(f"model.path: '{path}' has no config.json: point it at a Hugging Face checkpoint folder "
                        "(config.json + *.safetensors), or give model.config=FILE.json on the command line")


def _notice(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)
