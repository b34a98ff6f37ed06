"""LoRA through peft: inject adapters into the HF model (in place), and write them as a PEFT adapter folder.

`get_peft_model` replaces each target Linear with a LoRA layer (`base_layer` + `lora_A/B.default`) inside the model
object we already hold (whose forward we then route through one autograd Function: model/lora_linear.py), freezes every other parameter and records its `LoraConfig` as `model.peft_config`; the
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
from shardtune.errors import UserError

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

ADAPTER = "default"  # peft's adapter name: in parameter names, not in the saved keys
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def apply_lora(model: nn.Module, cfg: LoraConfig, *, base_name: str | None = None, seed: int = 0) -> nn.Module:
    """Inject adapters into `model` in place; returns the same object (the HF model, not peft's wrapper). Linear
    targets go through peft; fused expert weights get our per-expert adapters (model/experts.py), drawn from `seed`."""
    # peft is imported here, not at the top: a run without LoRA never pays for it (~0.4 s per worker)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from shardtune.model.experts import apply_expert_lora, use_grouped_experts
    from shardtune.model.lora_linear import use_fused_lora
    from shardtune.model.moe_checks import resolve_targets

    targets = resolve_targets(model, cfg.target_modules)
    if targets.missing:
        raise UserError(targets.problem())
    config = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                            target_modules=targets.linear or None, target_parameters=None if targets.linear else
                            targets.expert_weights, task_type="CAUSAL_LM", base_model_name_or_path=base_name)
    if targets.linear:
        with warnings.catch_warnings():
            # peft reads `model.is_gradient_checkpointing`, which transformers 5 deprecates: noise in every LoRA run's
            # output that the user can do nothing about (our engine does its own activation checkpointing)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, config)
        assert peft_model.base_model.model is model  # injection is in place: the trainer keeps calling `model`
        use_fused_lora(model)  # base matmul and adapter in one autograd Function (model/lora_linear.py)
    else:  # experts only: nothing for peft to inject; the base is frozen here and the config kept for the export
        model.requires_grad_(False)
        model.peft_config = {ADAPTER: config}
    # peft fills in the model's name_or_path, which for a model built from a config file is that config.json: the
    # adapter would name an architecture file as its base. The base is what the caller says (None: on no disk).
    config.base_model_name_or_path = base_name
    if targets.expert_weights:
        apply_expert_lora(model, weights=targets.expert_weights, r=cfg.r, alpha=cfg.alpha, seed=seed)
        config.target_parameters = list(targets.expert_weights)  # what PeftModel.from_pretrained re-creates
    if targets.has_experts:
        use_grouped_experts(model)
    check_exportable(model, config)
    return model


def check_exportable(model: nn.Module, config: PeftLoraConfig) -> None:
    """The adapter's export rehearsed on shapes alone (meta tensors: no data, no memory, ~ms): adapters that would
    train and then fail to be written as a PEFT folder stop the run here, before the first step, not at final/."""
    shapes = {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters() if is_adapter(n)}
    saved = peft_tensors(shapes, config)
    assert len(saved) == len(shapes), f"{len(shapes)} adapter tensors map to {len(saved)} PEFT keys"


def rehearse_lora(recipe) -> None:  # recipe: Recipe
    """validate's LoRA check on a mixture of experts: the adapters injected on a meta model (no memory; ~2 s for a
    30B MoE) and their export rehearsed (check_exportable), so targets that would train and then fail to save final/
    fail before any training. A dense model's adapters are peft's Linear adapters, saved one to one under peft's
    names: nothing to rehearse there that is worth peft's injection (~2 s on a 70B's 560 Linears)."""
    from transformers import AutoModelForCausalLM

    from shardtune.model.build import load_config
    from shardtune.model.experts import expert_modules
    from shardtune.model.loading import build_empty

    model = build_empty(lambda: AutoModelForCausalLM.from_config(load_config(recipe.model)))
    if not expert_modules(model):
        return
    with torch.device("meta"):  # the adapters too (apply_lora makes expert adapters on the default device)
        apply_lora(model, recipe.lora, seed=recipe.train.seed)


def lora_config(model: nn.Module) -> PeftLoraConfig | None:
    """The LoraConfig peft recorded on the model, or None without LoRA."""
    return getattr(model, "peft_config", {}).get(ADAPTER)


def is_adapter(name: str) -> bool:
    return f".{ADAPTER}." in name or name.endswith(f".{ADAPTER}")


def peft_key(name: str) -> str:
    """Our parameter name -> PEFT's saved key: `base_model.model.` prefix, adapter name dropped."""
    return "base_model.model." + ".".join(part for part in name.split(".") if part != ADAPTER)


def peft_tensors(tensors: dict[str, torch.Tensor], config: PeftLoraConfig) -> dict[str, torch.Tensor]:
    """{our parameter name: tensor} -> {PEFT's saved key: tensor}; expert adapters in peft's target_parameters layout."""
    from shardtune.model.experts import peft_expert_tensors

    out, targets = {}, list(getattr(config, "target_parameters", None) or [])
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(f".{ADAPTER}.")
        if leaf == "lora_A":  # an expert adapter, `<experts>.lora_<weight>.default.lora_A` (a Linear's ends .weight)
            prefix, _, attr = module.rpartition(".")
            out.update(peft_expert_tensors(peft_key(prefix), attr.removeprefix("lora_"), targets, t,
                                           tensors[f"{module}.{ADAPTER}.lora_B"]))
        elif leaf != "lora_B":  # an expert's lora_B goes with its lora_A
            out[peft_key(name)] = t
    return out


def save_adapter(tensors: dict[str, torch.Tensor], config: PeftLoraConfig, out: Path) -> None:
    """Write a PEFT adapter folder from {our parameter name: full tensor}; atomic weights file."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({k: t.contiguous() for k, t in peft_tensors(tensors, config).items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    config.save_pretrained(str(out))  # adapter_config.json
