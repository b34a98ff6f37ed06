"""Model and tokenizer through Hugging Face: random init from a config, or a local pretrained checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shardtune.config.schema import ModelConfig
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.errors import UserError
from shardtune.loading import build_empty

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_config(cfg: ModelConfig) -> PretrainedConfig:
    source = cfg.config or cfg.path
    assert source is not None, "schema guarantees config or path"
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        key = "model.config" if cfg.config else "model.path"
        raise UserError(f"{key}: cannot read an HF config from '{source}' ({str(e).splitlines()[0][:120]}): "
                        "point it at a config.json or a checkpoint folder") from None


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> PreTrainedModel:
    """Random init is seeded, so every rank builds identical weights before sharding. Pretrained: parameters on
    the meta device, buffers real; `parallelize` fills them (each rank reads only its shard)."""
    hf_config = load_config(cfg)
    dtype = DTYPES[cfg.dtype]
    if cfg.init == "pretrained":
        if not any(Path(cfg.path).glob("*.safetensors")):  # type: ignore[arg-type]
            raise UserError(f"model.path: no *.safetensors in '{cfg.path}': point it at an HF checkpoint folder")
        # Parameters on meta (no bytes); parallelize loads each rank's shard from the files (loading.py).
        return build_empty(lambda: AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=cfg.attn_implementation))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=cfg.attn_implementation)
    return model


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    source = cfg.tokenizer or cfg.path
    if source is None or source == "builtin:char":
        return build_char_tokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from '{source}' ({str(e).splitlines()[0][:120]}): "
                        "point it at a local tokenizer folder or tokenizer.json, or use builtin:char") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
