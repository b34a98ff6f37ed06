"""model/lora_linear.py: peft's LoRA Linear computed through one autograd Function. In fp32 the output and the
gradients of x, A and B equal peft's (bias, dropout, several modules reading one input); the module tree, the
parameter names and peft's save format are peft's; a forward+backward of one adapted Linear in bf16 issues 10 aten
kernels where peft's issues 17 (the adapters cast to bf16 once per step, while unchanged); layers the Function does not cover keep peft's forward."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import Linear as PeftLoraLinear
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.model.lora_linear import use_fused_lora

# Metadata and allocations: no kernel runs (what simulated/launches.py leaves out too)
_NOT_KERNELS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "detach",
                "lift_fresh", "_local_scalar_dense"}


class _Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if name not in _NOT_KERNELS and not func.is_view:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 48, bias=False)
        self.k = nn.Linear(64, 32, bias=False)
        self.o = nn.Linear(80, 64, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.q(x), self.k(x)], dim=-1))


def _pair(dropout: float = 0.0) -> tuple[nn.Module, nn.Module]:
    """(peft's model, the same weights through our forward); lora_B drawn non-zero so every gradient is."""
    torch.manual_seed(0)
    block = _Block()
    get_peft_model(block, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["q", "k", "o"]))
    for m in block.modules():
        if isinstance(m, PeftLoraLinear):
            nn.init.normal_(m.lora_B["default"].weight)
    ours = copy.deepcopy(block)
    assert len(use_fused_lora(ours)) == 3
    return block, ours


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # the same dropout masks
    y = model(x)
    (y.square().sum()).backward()
    return torch.cat([y.flatten(), x.grad.flatten()]), {n: p.grad for n, p in model.named_parameters()
                                                        if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_outputs_and_gradients_equal_peft_in_fp32(dropout: float) -> None:
    peft_model, ours = _pair(dropout)
    x = torch.randn(2, 5, 64)
    want, want_grads = _grads(peft_model, x)
    got, got_grads = _grads(ours, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert list(got_grads) == list(want_grads) and len(got_grads) == 6  # A and B of q, k, o: nothing else trains
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-4 * want_grads[name].abs().max().item())


def test_module_tree_and_peft_save_format_unchanged() -> None:
    peft_model, ours = _pair()
    assert all(isinstance(m, PeftLoraLinear) for m in (ours.q, ours.k, ours.o))
    assert type(ours.q).__name__ == "FusedLoraLinear"
    assert list(ours.state_dict()) == list(peft_model.state_dict())
    want, got = get_peft_model_state_dict(peft_model), get_peft_model_state_dict(ours)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def _launches(layer: nn.Module, x: torch.Tensor) -> list[str]:
    layer(x).sum().backward()  # the adapters' .grad exist: the counted pass accumulates like a second micro-batch
    mode = _Launches()
    with mode:
        layer(x).sum().backward()
    return mode.ops


def test_one_adapted_linear_issues_10_kernels_in_bf16_where_peft_issues_17() -> None:
    peft_model, ours = _pair()
    for model in (peft_model, ours):  # our engine's bf16 run: frozen base in bf16, adapters in fp32
        for p in model.parameters():
            p.data = p.data.to(torch.float32 if p.requires_grad else torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    # Besides the layer: the loss's sum and its ones_like, and the three .grad accumulations (x, A, B)
    outside = ["sum", "ones_like", "add_", "add_", "add_"]
    theirs, got = _launches(peft_model.q, x), _launches(ours.q, x)
    for ops in (theirs, got):
        for op in outside:
            ops.remove(op)
    assert len(theirs) == 17, theirs
    # forward: x W^T, u = x A^T, y += s·u B^T (A and B cast to bf16 by the first pass, unchanged since); backward:
    # g B, g W, += s·(g B) A, s·g^T u, s·(g B)^T x, and autograd's casts of the two adapter gradients to fp32
    assert sorted(got) == sorted(["_to_copy"] * 2 + ["mm"] * 4 + ["addmm_"] * 2 + ["addmm"] * 2), got


def _mixed_pair_after_a_forward():
    """peft's and our Linear with fp32 adapters over a bf16 base, and a bf16 input ours has run once (the bf16
    adapter copies are made)."""
    peft_model, ours = _pair()
    for model in (peft_model, ours):
        for p in model.parameters():
            p.data = p.data.to(torch.float32 if p.requires_grad else torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ours(x)  # the bf16 copies are made
    return peft_model, ours, x


def test_adapters_cast_again_after_the_optimizer_writes_them() -> None:
    peft_model, ours, x = _mixed_pair_after_a_forward()
    for model in (peft_model, ours):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.5)  # in place, as AdamW writes them
    want = peft_model(x)
    torch.testing.assert_close(ours(x), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    stale = copy.deepcopy(ours)
    stale.q.lora_B["default"].weight.data = ours.q.lora_B["default"].weight.data - 0.5  # a new tensor, version 0
    assert not torch.equal(stale.q(x), ours.q(x))


def test_adapters_cast_again_after_a_fused_adamw_step() -> None:
    """The CPU run's AdamW is the fused kernel, which writes the adapters without bumping their versions: the bf16
    copies made before a step must not serve the forward after it (they did: a run trained on step 1's adapters
    throughout, and a resume, casting afresh, lost exactness)."""
    peft_model, ours, x = _mixed_pair_after_a_forward()
    for model in (peft_model, ours):
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(params, lr=0.5, fused=True).step()
    a = ours.q.lora_A["default"].weight
    assert torch.equal(a, peft_model.q.lora_A["default"].weight)  # both stepped
    want = peft_model(x)
    torch.testing.assert_close(ours(x), want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_layers_the_function_does_not_cover_keep_peft_forward() -> None:
    peft_model, ours = _pair()
    x = torch.randn(2, 5, 64)
    for model in (peft_model, ours):
        model.q.merge()  # merged: the base alone
        model.k.enable_adapters(False)  # adapters off: the base alone
    with _Launches() as mode:
        ours(x)
    assert "addmm_" in mode.ops  # o still runs our Function
    torch.testing.assert_close(ours(x), peft_model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.k(x), ours.k.base_layer(x))


def test_apply_lora_routes_every_adapted_linear_through_the_function() -> None:
    from shardtune.config.schema import LoraConfig as OurLoraConfig
    from shardtune.config.schema import ModelConfig
    from shardtune.model.build import build_model
    from shardtune.model.lora import apply_lora

    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    apply_lora(model, OurLoraConfig(enabled=True, r=8, target_modules=["q_proj", "down_proj"]))
    adapted = [m for m in model.modules() if isinstance(m, PeftLoraLinear)]
    assert adapted and {type(m).__name__ for m in adapted} == {"FusedLoraLinear"}
    assert all(n.endswith(("q_proj", "down_proj")) for n, m in model.named_modules() if m in adapted)
