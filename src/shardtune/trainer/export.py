"""`final/` (HF format, gathered unit by unit to rank 0) and the export info a checkpoint carries."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune import accelerator
from shardtune.checkpoint.generation import with_tokenizer_ids
from shardtune.engine.api import ShardedModel
from shardtune.engine.torch_backend import full_tensor
from shardtune.model.lora import is_adapter, lora_config, save_adapter


def save_final(sharded: ShardedModel, hf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path,
               *, is_main: bool) -> None:
    """Collective: every rank iterates the state dict; rank 0 writes. Tied weights appear once (HF re-ties).
    Under LoRA, `out` is a PEFT adapter folder (adapters only: the base is whatever it was loaded from)."""
    config = lora_config(hf_model)
    if config is not None:
        adapters = {n: _full(p) for n, p in hf_model.named_parameters() if is_adapter(n)}  # replicated (ours)
        if is_main:
            save_adapter(adapters, config, out)
            tok.save_pretrained(out)
        return
    state = {name: t.contiguous() for name, t in sharded.full_state_dict()}
    if not is_main:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    try:
        save_file(state, str(tmp), metadata={"format": "pt"})
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file left behind
        raise
    tmp.replace(out / "model.safetensors")  # atomic: a crash never leaves a half-written model file
    hf_model.config.save_pretrained(out)
    _save_generation_config(hf_model, tok, out)
    tok.save_pretrained(out)


def _save_generation_config(hf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path) -> None:
    """The model's generation config (a pretrained model's own, else one from its config), stopping at the
    tokenizer's eos too: what `from_pretrained(...).generate()` reads."""
    from transformers import GenerationConfig

    gen = hf_model.generation_config or GenerationConfig.from_model_config(hf_model.config)
    with_tokenizer_ids(gen, tok).save_pretrained(out)


def _full(p: torch.Tensor) -> torch.Tensor:
    """A whole CPU copy of a parameter; collective for FSDP2's DTensors (every rank calls it in the same order)."""
    return accelerator.to_host(full_tensor(p.detach()), torch.float32, copy=True)


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
    config = lora_config(hf_model)
    if config is None:
        _save_generation_config(hf_model, tok, out)  # `shardtune export` copies it beside the full model
    else:
        config.save_pretrained(str(out))  # adapter_config.json: `shardtune export` writes a PEFT adapter
        # The trainer read `shapes` before parallelize injected the adapters; adapters stay whole, read them now.
        shapes = {n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                  for n, p in hf_model.named_parameters() if is_adapter(n)}
    (out / "params.json").write_text(json.dumps(shapes, indent=1))
