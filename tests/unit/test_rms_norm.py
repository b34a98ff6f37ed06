"""model/rms_norm.py: transformers' Llama-style RMSNorms through torch's F.rms_norm (one fused kernel each way on
CUDA): outputs and input gradients bit-identical to transformers' on the CPU in fp32 and bf16, state_dict keys
unchanged, every norm of a Llama and of a Qwen3 (q/k norms too) swapped, Gemma's norm (1 + weight) left alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from shardtune.model.rms_norm import use_fused_rms_norm

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, head_dim=16)


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_norms_equal_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(dtype)
    theirs = copy.deepcopy(model)
    changed = use_fused_rms_norm(model)
    assert len(changed) == 2 * 2 + 1  # two per block and the final norm
    assert list(model.state_dict()) == list(theirs.state_dict())
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"  # the tree reads as before
    for ours, ref in ((model.model.layers[0].input_layernorm, theirs.model.layers[0].input_layernorm),
                      (model.model.norm, theirs.model.norm)):
        with torch.no_grad():
            ref.weight.normal_()
            ours.weight.copy_(ref.weight)
        x = (torch.randn(2, 7, 64) * 3).to(dtype)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        with _Calls() as calls:
            y = ours(xs[0])
        assert torch.nn.functional.rms_norm in calls.funcs
        y_ref = ref(xs[1])
        assert torch.equal(y, y_ref)
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g)
        assert torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(ours.weight.grad, ref.weight.grad)


def test_qwen3_head_norms_swapped_gemma_norm_kept() -> None:
    qwen = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    assert len(use_fused_rms_norm(qwen)) == 2 * 4 + 1  # input, post-attention, q and k norms per block; final
    gemma = GemmaForCausalLM(GemmaConfig(**SMALL))
    assert use_fused_rms_norm(gemma) == []  # (1 + weight), computed in fp32: not Llama's arithmetic


def test_build_model_routes_the_norms_through_rms_norm() -> None:
    from shardtune.config.schema import ModelConfig
    from shardtune.model.build import build_model

    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(type(m).__module__ == "shardtune.model.rms_norm" for m in norms)
