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
    """(the reused tile buffer, the transient of one grouped matmul) for NF4 experts [E, a, b]
    (engine/nf4_experts.py): the larger of a forward tile (rows of every expert) and a backward slab (columns of every
    expert's rows), each within what `tile` bytes of whole experts hold, dequantized into the buffer; its int32 code
    index (2 B/weight of the tile) and the whole weight's block scalers (c/64 B/weight)."""
    from shardtune.engine.nf4_experts import expert_tiles

    e, a, b = shape
    rows, cols = expert_tiles(shape, c, tile)
    weights = max(e * rows * b, e * a * cols)
    return weights * c, weights * 2 + e * a * b // 64 * c


def routing_bytes(moe: MoeDims, hidden: int, tokens: int, c: int, *, lora: bool, adapter_numel: int = 0) -> int:
    """What a MoE layer saves beyond the routed MLP's intermediates (Dims.intermediate = top_k x the expert's width):
    the token rows gathered per expert and the experts' outputs before the routing weights (2 x top_k rows of hidden
    per token, compute dtype), the router's fp32 logits and softmax (2 x experts x 4 B) and its int64 top-k indices
    and sort permutation (24 B per routed slot). Expert adapters make the down projection's grouped matmul save its
    input, act(gate)·up (top_k rows of the expert's width per token: a dense LoRA MLP does not keep it), and in a
    bf16 run their bf16 casts (`adapter_numel` weights of the layer). Measured with saved_tensors_hooks on Qwen3-MoE
    (8 experts, top-2, hidden = expert width 256): 12404 B/token (fp32) vs 12400 here; the simulated Qwen3-30B-A3B
    (hidden 2048, expert width 768) tells the two widths apart."""
    k = moe.top_k
    per_token = 2 * k * hidden * c + 2 * moe.num_experts * 4 + 24 * k + (k * moe.intermediate * c if lora else 0)
    return tokens * per_token + (adapter_numel * c if lora and c != 4 else 0)


def unpermute_bytes(moe: MoeDims, hidden: int, tokens: int, c: int) -> int:
    """The transient around a MoE layer's un-permute (experts.experts_forward), on top of its saved set, in its
    backward: 3 x top_k rows of hidden per token. Its backward holds the gradient of the (tokens, top_k, hidden)
    output copied out of its broadcast, that gradient un-permuted, and the two products of the routing weights'
    backward. A checkpointed layer is recomputed once that first gradient exists (the un-permute's saved index is
    needed), and the replay holds the rows times their routing weights and their copy gathered back to token order. A
    dense MLP's backward (2 x b·s·i) is the larger transient only for narrow routing."""
    return 3 * tokens * moe.top_k * hidden * c
