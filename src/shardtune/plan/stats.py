"""Model facts for `plan`, read from a meta-device build (no weights, no memory: a 70B model in ~0.1 s):
parameter counts, the engine's per-unit flat layout (engine/layout.py, the code the engine itself uses), the
architecture dims the activation model needs, and LoRA adapter sizes.

The build is skeleton.py's torch-only stand-in for the Llama family (no transformers import: `plan` and the
launcher's pre-flight stay ~3 s cheaper); other architectures are built by transformers itself."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from shardtune.config.dtypes import DTYPES
from shardtune.config.schema import ModelConfig, Recipe
from shardtune.engine.api import MixedPrecision, ShardingPolicy
from shardtune.engine.layout import UnitLayout, unit_layouts
from shardtune.engine.wrap import resolve_unit_classes
from shardtune.model.attention import sliding_window
from shardtune.plan import skeleton
from shardtune.plan.moe import MoeDims


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    moe: MoeDims | None = None  # mixture of experts: routing dims (plan/moe.py)
    window: int | None = None  # sliding-window attention (model/attention.py's band), on some layer at least
    attention_dropout: float = 0.0  # the config's; > 0 keeps packed rows off the GPU's varlen kernel

    @classmethod
    def from_config(cls, c) -> Dims:  # an HF PretrainedConfig, or skeleton.config_namespace
        heads = c.num_attention_heads
        moe = MoeDims.from_config(c)
        # A MoE layer's MLP runs each token through top_k experts: per token, top_k x the expert's width of
        # intermediate activations (the routed tokens), where a dense MLP has intermediate_size.
        inter = moe.top_k * moe.intermediate if moe else c.intermediate_size
        return cls(hidden=c.hidden_size, intermediate=inter, num_layers=c.num_hidden_layers,
                   num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab=c.vocab_size, moe=moe,
                   window=sliding_window(c), attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0))

    @property
    def mlp_weight_numel(self) -> int:
        """One MLP projection's weight: a dense down_proj, or a MoE layer's fused down_proj of every expert."""
        if self.moe:
            return self.moe.num_experts * self.hidden * self.moe.intermediate
        return self.hidden * self.intermediate


def build_meta_model(cfg: ModelConfig) -> tuple[nn.Module, Dims]:
    raw = skeleton.read_config_json(cfg)
    if raw is not None and skeleton.supported(raw):
        return skeleton.build_skeleton(raw, DTYPES[cfg.dtype]), Dims.from_config(skeleton.config_namespace(raw))
    from shardtune.model.build import (  # ~3 s of imports: only where skeleton.py cannot stand in
        from_config,
        load_config,
    )

    hf_config = load_config(cfg)
    with torch.device("meta"):
        model = from_config(cfg, hf_config, dtype=DTYPES[cfg.dtype])
    return model, Dims.from_config(hf_config)


class ModelStats:
    """One meta-device model per recipe; layouts computed per (shard size, LoRA) on demand."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.model, self.dims = build_meta_model(recipe.model)
        self.num_params = sum(p.numel() for p in self.model.parameters())  # tied weights once
        self._layouts: dict[tuple[int, bool, torch.dtype, bool], list[UnitLayout]] = {}

    @cached_property
    def unit_classes(self) -> tuple[type[nn.Module], ...]:
        wrap = self.recipe.engine.wrap
        return resolve_unit_classes(self.model, list(wrap) if not isinstance(wrap, (str, int)) else wrap)

    def layouts(self, shard_size: int, *, frozen_base: bool, base_dtype: torch.dtype,
                nf4: bool = False, nf4_dtype: torch.dtype | None = None,
                vocab_parallel: bool = False) -> list[UnitLayout]:
        """The engine's units for this shard-group size. `frozen_base`: every base param frozen (LoRA), in
        `base_dtype`; else all trainable in the model dtype. `nf4`: the units' frozen Linear weights as NF4 bytes
        (lora.quantize_base=nf4), dequantized to `nf4_dtype` (default `base_dtype`)."""
        key = (shard_size, frozen_base, base_dtype, nf4, nf4_dtype, vocab_parallel)
        if key not in self._layouts:
            wrap = self.recipe.engine.wrap
            policy = ShardingPolicy(unit_classes=self.unit_classes,
                                    min_unit_params=wrap if isinstance(wrap, int) and not isinstance(wrap, bool) else None,
                                    mixed_precision=MixedPrecision(param_dtype=nf4_dtype or base_dtype),
                                    quantize_base=nf4,
                                    vocab_parallel=vocab_parallel)
            saved = {id(p): (p.requires_grad, p.data) for p in self.model.parameters()}
            try:
                for p in self.model.parameters():
                    p.requires_grad_(not frozen_base)
                    if frozen_base and p.dtype != base_dtype:
                        p.data = p.data.to(base_dtype)
                self._layouts[key] = unit_layouts(self.model, policy, shard_size)
            finally:
                for p in self.model.parameters():
                    grad, data = saved[id(p)]
                    p.data = data
                    p.requires_grad_(grad)
        return self._layouts[key]

    def tied_tables(self) -> bool:
        """The embedding and the head share one weight (gemma, qwen3, tiny-qwen2)."""
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        return emb is not None and head is not None and emb.weight is head.weight

    def lora_params(self) -> int:
        """Adapter params peft would add: r·(in + out) per targeted Linear (matched by the module name's last part)."""
        return sum(self.lora_sizes())

    def expert_adapter_numel(self) -> int:
        """Adapter params on fused expert weights (per expert, every layer)."""
        from shardtune.model.experts import expert_weights, in_out, is_experts
        from shardtune.model.moe_checks import resolve_targets

        lora = self.recipe.lora
        targets = resolve_targets(self.model, lora.target_modules)
        return sum(lora.r * (fi + fo) * e for _, m in self.model.named_modules() if is_experts(m)
                   for w in expert_weights(m) if w in targets.expert_weights for e, fi, fo in [in_out(m, w)])

    def lora_sizes(self) -> list[int]:
        """Each adapter tensor's numel in named_parameters() order: lora_A (r x in), then lora_B (out x r); an expert
        weight's adapters hold r x (in + out) per expert."""
        from shardtune.model.experts import expert_weights, in_out, is_experts
        from shardtune.model.moe_checks import resolve_targets

        lora = self.recipe.lora
        targets = resolve_targets(self.model, lora.target_modules)
        sizes = []
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets.linear:
                sizes += [lora.r * m.in_features, lora.r * m.out_features]
            elif is_experts(m):
                for w in (w for w in expert_weights(m) if w in targets.expert_weights):
                    e, fan_in, fan_out = in_out(m, w)
                    sizes += [e * lora.r * fan_in, e * lora.r * fan_out]
        return sizes

    def buffer_bytes(self) -> int:
        """Module buffers (rotary inv_freq, ...): replicated, not sharded, kept in their own dtype."""
        return sum(b.numel() * b.element_size() for b in self.model.buffers())

    def has_qkv_bias(self) -> bool:
        return any(getattr(m, "bias", None) is not None for n, m in self.model.named_modules()
                   if n.endswith(("q_proj", "k_proj", "v_proj")))
