"""A meta-device stand-in for the HF decoder models `plan` knows, built with torch alone.

Why: building the real HF model class imports `transformers.modeling_utils`, which pulls torch._dynamo,
torch.distributed.tensor, the quantizers (torchao when installed) and more: ~3 s of a 5-6 s `plan` on 2 cores, and
the reason the launcher's pre-flight check could not be cheap. The plan only needs what the engine's layout reads:
parameter names, shapes, dtypes, tied weights, the decoder-block class (by name) and the buffers. For the
Llama-family blocks below (same block: q/k/v/o + gate/up/down + two RMSNorms) that is a few lines of data;
tests/unit/plan/test_skeleton.py checks it against the real HF build for every bundled model config, parameter by
parameter. Any other `model_type`, or a config that leaves a structural key to HF's defaults, takes the HF path.
"""
from __future__ import annotations

import torch
from torch import nn

from shardtune.plan.arch import FAMILIES, config_namespace, read_config_json, supported

__all__ = ["build_skeleton", "config_namespace", "read_config_json", "supported"]


class _Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """No init: on meta it would still route through torch._refs, whose first use imports torch._dynamo (~2 s)."""


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No init (see _Linear)."""


_Linear.__name__, _Embedding.__name__ = "Linear", "Embedding"  # as engine.wrap=[...] names them in the HF model


def build_skeleton(raw: dict, dtype: torch.dtype) -> nn.Module:
    """Same module tree, parameter names/shapes and buffers as `AutoModelForCausalLM.from_config` on meta."""
    fam, c = FAMILIES[raw["model_type"]], config_namespace(raw)
    qkv_bias = fam.qkv_bias_always or bool(fam.qkv_bias_key and raw.get(fam.qkv_bias_key, False))
    o_bias = bool(fam.qkv_bias_key and raw.get(fam.qkv_bias_key, False))
    # the unit class engine.wrap names; the families' blocks feed the post-attention norm only to the MLP
    # (model/tiled_mlp.py reads this for a block with no source; tests/unit/plan/test_skeleton.py checks HF's)
    block = type(f"{fam.prefix}DecoderLayer", (nn.Module,), {"NORM_FEEDS_ONLY_MLP": True})
    names = {k: type(f"{fam.prefix}{k}", (nn.Module,), {}) for k in ("Attention", "MLP", "RMSNorm", "Model",
                                                                     "RotaryEmbedding")}
    # the families' attentions apply Llama's rotary word for word: the engine fuses it (model/rotary.py fused_in)
    names["Attention"].ROTATES_LIKE_LLAMA = True
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size

    def linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
        return _Linear(n_in, n_out, bias=bias, device="meta", dtype=dtype)

    def norm() -> nn.Module:
        m = names["RMSNorm"]()
        m.weight = nn.Parameter(torch.empty(h, device="meta", dtype=dtype))
        return m

    def layer() -> nn.Module:
        m, attn, mlp = block(), names["Attention"](), names["MLP"]()
        attn.q_proj, attn.k_proj = linear(h, q, qkv_bias), linear(h, kv, qkv_bias)
        attn.v_proj, attn.o_proj = linear(h, kv, qkv_bias), linear(q, h, o_bias)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = linear(h, i, False), linear(h, i, False), linear(i, h, False)
        m.self_attn, m.mlp, m.input_layernorm, m.post_attention_layernorm = attn, mlp, norm(), norm()
        return m

    body = names["Model"]()
    body.embed_tokens = _Embedding(c.vocab_size, h, device="meta", dtype=dtype)
    body.layers = nn.ModuleList(layer() for _ in range(c.num_hidden_layers))
    body.norm = norm()
    body.rotary_emb = names["RotaryEmbedding"]()
    for buf in ("inv_freq", "original_inv_freq"):  # fp32, head_dim / 2, non-persistent
        body.rotary_emb.register_buffer(buf, torch.empty(c.head_dim // 2, device="meta"), persistent=False)
    root = type(f"{fam.prefix}ForCausalLM", (nn.Module,), {
        "_no_split_modules": [block.__name__],
        # what the engine's layout asks for the vocabulary tables (layout.vocab_tables)
        "get_input_embeddings": lambda self: self.model.embed_tokens,
        "get_output_embeddings": lambda self: self.lm_head})()
    root.model = body
    root.lm_head = linear(h, c.vocab_size, False)
    if c.tie_word_embeddings:
        root.lm_head.weight = body.embed_tokens.weight
    return root
