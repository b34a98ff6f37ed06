"""LoRA through peft: inject adapters into the HF model (in place), and write them as a PEFT adapter folder.

`get_peft_model` replaces each target Linear with a LoRA layer (`base_layer` + `lora_A/B.default`) inside the model
object we already hold, freezes every other parameter and records its `LoraConfig` as `model.peft_config`; the
engine then shards the frozen base and keeps the adapters replicated (see engine/replicated.py). The adapter folder
(`adapter_config.json` + `adapter_model.safetensors`, PEFT's key names) loads with `PeftModel.from_pretrained`.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from shardtune.config.schema import LoraConfig

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

ADAPTER = "default"  # peft's adapter name: in parameter names, not in the saved keys
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def apply_lora(model: nn.Module, cfg: LoraConfig, *, base_name: str | None = None) -> nn.Module:
    """Inject adapters into `model` in place; returns the same object (the HF model, not peft's wrapper)."""
    # peft is imported here, not at the top: a run without LoRA never pays for it (~0.4 s per worker)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                            target_modules=list(cfg.target_modules), task_type="CAUSAL_LM",
                            base_model_name_or_path=base_name)
    with warnings.catch_warnings():
        # peft reads `model.is_gradient_checkpointing`, which transformers 5 deprecates: noise in every LoRA run's
        # output that the user can do nothing about (our engine does its own activation checkpointing)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    assert peft_model.base_model.model is model  # injection is in place: the trainer keeps calling `model`
    # peft fills in the model's name_or_path, which for a model built from a config file is that config.json: the
    # adapter would name an architecture file as its base. The base is what the caller says (None: on no disk).
    lora_config(model).base_model_name_or_path = base_name
    return model


def lora_config(model: nn.Module) -> PeftLoraConfig | None:
    """The LoraConfig peft recorded on the model, or None without LoRA."""
    return getattr(model, "peft_config", {}).get(ADAPTER)


def is_adapter(name: str) -> bool:
    return f".{ADAPTER}." in name or name.endswith(f".{ADAPTER}")


def peft_key(name: str) -> str:
    """Our parameter name -> PEFT's saved key: `base_model.model.` prefix, adapter name dropped."""
    return "base_model.model." + ".".join(part for part in name.split(".") if part != ADAPTER)


def save_adapter(tensors: dict[str, torch.Tensor], config: PeftLoraConfig, out: Path) -> None:
    """Write a PEFT adapter folder from {our parameter name: full tensor}; atomic weights file."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({peft_key(n): t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    config.save_pretrained(str(out))  # adapter_config.json
