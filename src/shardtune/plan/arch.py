"""What `plan` reads from a model's config.json without torch or transformers: the Llama-family architectures
skeleton.py can stand in for (and bound.py can bound), and their dims with HF's defaults."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from shardtune.config.schema import ModelConfig
from shardtune.hub import model_dir


@dataclass(frozen=True)
class Family:
    prefix: str  # HF class-name prefix: LlamaDecoderLayer, Qwen2ForCausalLM, ...
    qkv_bias_key: str | None  # config key that switches q/k/v biases on (HF default False), or None
    qkv_bias_always: bool = False  # Qwen2: q/k/v always have a bias, o_proj never


FAMILIES = {"llama": Family("Llama", "attention_bias"), "mistral": Family("Mistral", None),
            "qwen2": Family("Qwen2", None, qkv_bias_always=True)}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config_json(cfg: ModelConfig) -> dict | None:
    """The raw config.json of `model.config` (a file) or `model.path` (a folder); None when unreadable here (the
    HF path then reports the error properly)."""
    source = cfg.config or cfg.path
    if source is None:
        return None
    path = Path(source) if cfg.config else model_dir(source)
    path = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def supported(raw: dict) -> bool:
    fam = FAMILIES.get(raw.get("model_type", ""))
    return (fam is not None and all(isinstance(raw.get(k), int) for k in REQUIRED)
            and raw.get("architectures", [f"{fam.prefix}ForCausalLM"]) == [f"{fam.prefix}ForCausalLM"]
            and not raw.get("mlp_bias") and raw.get("partial_rotary_factor", 1.0) == 1.0
            # the activation counts measured for estimate.py are SiLU's; any other goes through transformers, which
            # also refuses one it does not know (model.from_config)
            and raw.get("hidden_act", "silu") == "silu")


def config_namespace(raw: dict) -> SimpleNamespace:
    """The attributes `Dims.from_config` reads, with HF's defaults for the optional ones."""
    heads = raw["num_attention_heads"]
    return SimpleNamespace(**{k: raw[k] for k in REQUIRED},
                           num_key_value_heads=raw.get("num_key_value_heads") or heads,
                           head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                           tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                           sliding_window=raw.get("sliding_window"),
                           use_sliding_window=raw.get("use_sliding_window", True),
                           layer_types=raw.get("layer_types"), attention_dropout=raw.get("attention_dropout", 0.0))
