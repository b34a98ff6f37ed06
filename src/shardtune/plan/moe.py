"""`plan` for mixtures of experts: the routing dims from the HF config, the activations of the routed tokens, and
the NF4 experts' tile buffer (engine/nf4_experts.py). The parameters of every expert need nothing here: they are
the experts modules' 3-D parameters, counted and laid into unit buffers like any weight (engine/layout.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeDims:
    num_experts: int
    top_k: int  # experts per token: each token's MLP input is processed top_k times
    intermediate: int  # each expert's intermediate size

    @classmethod
    def from_config(cls, c) -> MoeDims | None:  # an HF PretrainedConfig; None for a dense model
        experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
        if not experts:
            return None
        top_k = getattr(c, "num_experts_per_tok", None) or getattr(c, "experts_per_token", None)
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        return cls(num_experts=experts, top_k=top_k, intermediate=inter)


def nf4_experts_bytes(shape: tuple[int, int, int], c: int, tile: int) -> tuple[int, int]:
    """(the reused tile buffer, the transient of one grouped matmul) for NF4 experts [E, a, b]: a run of experts
    dequantized into the buffer (as many whole experts as `tile` bytes hold, at least one), its int32 code index
    (2 B/weight of the run) and the whole weight's block scalers (c/64 B/weight)."""
    e, a, b = shape
    per_expert = a * b * c
    run = max(1, min(e, tile // per_expert if tile else e))
    return run * per_expert, run * a * b * 2 + e * a * b // 64 * c


def routing_bytes(moe: MoeDims, hidden: int, tokens: int, c: int, *, lora: bool, adapter_numel: int = 0) -> int:
    """What a MoE layer saves beyond the routed MLP's intermediates (Dims.intermediate = top_k x the expert's width):
    the token rows gathered per expert and the experts' outputs before and after the routing weights (3 x top_k
    rows of hidden per token, compute dtype, one of them freed by the un-permute), the router's fp32 logits and
    softmax (2 x experts x 4 B) and its int64 top-k indices and sort permutation (24 B per routed slot). Expert
    adapters add one (rows, hidden) tensor per token slot, and in a bf16 run their bf16 casts (`adapter_numel`
    weights of the layer), which the grouped matmuls save for backward. Measured with saved_tensors_hooks on
    Qwen3-MoE (8 experts, top-2): 12404 B/token (fp32) vs 12400 here."""
    k = moe.top_k
    per_token = 2 * k * hidden * c + 2 * moe.num_experts * 4 + 24 * k + (k * hidden * c if lora else 0)
    return tokens * per_token + (adapter_numel * c if lora and c != 4 else 0)
