"""`final/` (HF format, gathered unit by unit to rank 0) and the export info a checkpoint carries."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune.engine.api import ShardedModel


def save_final(sharded: ShardedModel, hf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path,
               *, is_main: bool) -> None:
    """Collective: every rank iterates the state dict; rank 0 writes. Tied weights appear once (HF re-ties)."""
    state = {name: t.contiguous() for name, t in sharded.full_state_dict()}
    if not is_main:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")  # atomic: a crash never leaves a half-written model file
    hf_model.config.save_pretrained(out)
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def param_shapes(model: PreTrainedModel) -> dict[str, dict[str, Any]]:
    """Names, shapes and dtypes of the trainable parameters, read before sharding (checkpoints store them 1-D)."""
    return {n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for n, p in model.named_parameters() if p.requires_grad}


def write_export_info(hf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, shapes: dict[str, Any],
                      out: Path) -> None:
    """What `shardtune export` needs beside the shards: config, tokenizer, parameter shapes."""
    out.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "params.json").write_text(json.dumps(shapes, indent=1))
