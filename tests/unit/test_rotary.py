"""model/rotary.py: a layer's q and k rotated together in one autograd Function: outputs and input gradients
bit-identical to transformers' `apply_rotary_pos_emb` on the CPU in fp32 and bf16 (grouped heads, a batch of position
rows), every attention of a Llama and a Qwen3 swapped with unchanged state_dict keys and bit-identical logits and
gradients (Qwen3's q/k norm weights in fp32: equal up to the order of their sum over tokens, since the rotated
q and k's gradient is laid out [b, s, heads, d], as the projections' outputs), Phi-3's own rotary (partial rotary, its own function) left alone; 6 kernels each way on meta, where
transformers' issues 10 forward and 14 backward."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from shardtune.model.rotary import apply_rotary, use_fused_rotary
from shardtune.simulated.launches import LaunchCounter

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, head_dim=16)


def _qk_cos_sin(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """q [2, 4, 9, 16] and k [2, 2, 9, 16] as the projections lay them out (transposed views), cos/sin of two rows
    of restarting positions (packed documents), from transformers' own rotary embedding."""
    b, s, d = 2, 9, 16
    q = (torch.randn(b, s, 4, d) * 3).to(dtype).to(device).transpose(1, 2)
    k = (torch.randn(b, s, 2, d) * 3).to(dtype).to(device).transpose(1, 2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]], device=device)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**SMALL)).to(device)(q, positions)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q0, k0, cos, sin = _qk_cos_sin(dtype)
    grads = (torch.randn(2, 4, 9, 16).to(dtype), torch.randn(2, 2, 9, 16).to(dtype))
    results = []
    for fn in (apply_rotary, apply_rotary_pos_emb):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qr, kr = fn(q, k, cos, sin)
        torch.autograd.backward((qr, kr), grads)
        results.append((qr.detach(), kr.detach(), q.grad, k.grad))
    for ours, ref in zip(*results, strict=True):
        assert ours.shape == ref.shape and ours.dtype == ref.dtype
        assert torch.equal(ours, ref)
    assert results[0][0].transpose(1, 2).stride(-1) == 1  # [b, s, heads, d] rows: the attention's layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_and_qwen3_attentions_swapped_logits_and_grads_unchanged(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for cls, config in ((LlamaForCausalLM, LlamaConfig), (Qwen3ForCausalLM, Qwen3Config)):
        model = cls(config(**SMALL)).to(dtype)
        theirs = copy.deepcopy(model)
        changed = use_fused_rotary(model)
        assert len(changed) == 2 and all(type(m).__name__ == type(r).__name__ for m, r in
                                         zip(changed, (theirs.model.layers[i].self_attn for i in range(2))))
        assert list(model.state_dict()) == list(theirs.state_dict())
        ids = torch.randint(0, 128, (2, 11))
        positions = torch.tensor([list(range(6)) + list(range(5)), list(range(11))])
        outs = [m(input_ids=ids, position_ids=positions).logits for m in (model, theirs)]
        assert torch.equal(outs[0], outs[1])
        g = torch.randn_like(outs[0])
        for out in outs:
            out.backward(g)
        for (name, p), (_, r) in zip(model.named_parameters(), theirs.named_parameters(), strict=True):
            if name.endswith(("q_norm.weight", "k_norm.weight")) and dtype == torch.float32:
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)  # a sum over tokens, reordered
            else:
                assert torch.equal(p.grad, r.grad), name


def test_phi3_keeps_its_own_rotary_and_a_swap_is_once() -> None:
    assert use_fused_rotary(Phi3ForCausalLM(Phi3Config(**SMALL, pad_token_id=0))) == []  # its own apply_rotary
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    assert len(use_fused_rotary(model)) == 2 and use_fused_rotary(model) == []


def test_six_kernels_each_way_where_transformers_issues_ten_and_fourteen() -> None:
    """On meta (the simulated GPU's tensors): concatenation, x·cos, roll, ·sin, the two half-sums; backward the
    same. transformers': per tensor two products, a negation, a concatenation, a sum; backward products, a
    negation, zero-padded slice gradients and their sums."""
    counts = []
    for fn in (apply_rotary, apply_rotary_pos_emb):
        q, k, cos, sin = _qk_cos_sin(torch.bfloat16, "meta")
        q.requires_grad_(), k.requires_grad_()
        with LaunchCounter(1) as counter:
            qr, kr = fn(q, k, cos, sin)
            forward = counter.counts[0, "forward"]
            # to q and k's gradients (a leaf's would be copied into its own layout by AccumulateGrad: not rotary's)
            torch.autograd.grad((qr, kr), (q, k), (torch.empty_like(qr), torch.empty_like(kr)))
        counts.append((forward, counter.counts[0, "backward"]))
    assert counts == [(6, 6), (10, 14)], counts
