"""`shardtune export`: which folder to read, what to write beside the model, and where it goes after.

The source is a checkpoint (`step_N`, or a checkpoints/ folder: its newest) or, with --merge, a LoRA run's final/
adapter folder. Beside the model goes the prompt record (model/prompt_style.py), so `generate` on the exported folder
asks the model the way the run trained it. --push-to-hub uploads the finished folder as one commit.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

from shardtune.checkpoint.paths import latest_checkpoint, prepare_target
from shardtune.errors import UserError


def source_folder(checkpoint: Path, *, merge: bool) -> Path:
    """The checkpoint to read; a run's final/ (a PEFT adapter) only with --merge (it is already exported)."""
    if (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "trainer.json").is_file():
        if not merge:
            raise UserError(f"export: '{checkpoint}' is already a PEFT adapter folder: use it as is, or add --merge "
                            "to write the base with the adapter merged")
        return checkpoint
    if (checkpoint / "config.json").is_file() and not (checkpoint / "trainer.json").is_file():
        raise UserError(f"export: '{checkpoint}' is already an HF model folder: use it as is (export reads "
                        "<output_dir>/checkpoints/step_N)")
    return latest_checkpoint(checkpoint)


def run_export(checkpoint: Path, out: Path, *, merge: bool, max_shard_bytes: int, force: bool,
               push_to_hub: str | None) -> list[Path]:
    src = source_folder(checkpoint, merge=merge)
    if push_to_hub is not None:
        from shardtune.hub import check_repo_id

        check_repo_id(push_to_hub, "--push-to-hub")
    prepare_target(out, force=force)  # before torch is imported: a refusal takes a moment
    from shardtune.checkpoint.consolidate import export_checkpoint
    from shardtune.checkpoint.merge import merge_checkpoint
    from shardtune.trainer.progress import ExportProgress

    write = merge_checkpoint if merge else export_checkpoint
    progress = ExportProgress()
    try:
        files = write(src, out, max_shard_bytes=max_shard_bytes, progress=progress)
    finally:
        progress.close()
    _record_prompt_style(src, out)
    _warn_if_no_base(out)
    if push_to_hub is not None:
        from shardtune.hub import push_folder

        push_folder(out, push_to_hub)
    return files


def _warn_if_no_base(out: Path) -> None:
    """An adapter over a random init names no base: say so where it is written, with what generate will need (not
    in generate's own consolidation of a checkpoint, which knows the run)."""
    config = out / "adapter_config.json"
    if config.is_file() and json.loads(config.read_text()).get("base_model_name_or_path") is None:
        warnings.warn(f"the adapter in '{out}' names no base model (base_model_name_or_path: null): its run started "
                      "from a random init, which is on no disk. `shardtune generate` needs the run directory, or "
                      "the adapter with --base MODEL_FOLDER; `shardtune export --merge` writes base and adapter as one "
                      "model", stacklevel=2)


def _record_prompt_style(src: Path, out: Path) -> None:
    from shardtune.launcher.generate import find_recipe
    from shardtune.model.prompt_style import style_of_recipe, write_style

    recipe = find_recipe(src)
    if recipe is not None:
        write_style(out, style_of_recipe(recipe))
