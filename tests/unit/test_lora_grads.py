"""model/lora_grads.py: adapter gradients summed a block at a time outside autograd, once opted in. In a bf16 run
(fp32 adapters over a bf16 base) over micro-batches and checkpointed recomputes the `.grad` are autograd's, bit for
bit; per micro-batch one kernel per block moves them, where autograd issued a cast per adapter and, after the first
micro-batch, an add; the adapters' compute copies are cast for a whole block in one multi-tensor kernel; a hook on an
adapter, a Linear left out of a backward or a `.grad` replaced keep the sums right. (Bit for bit on these shapes; the
CPU's addmm into a given out= can round a product's last bf16 bit otherwise: lora_grads' docstring.)"""
from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.model.lora_grads import take_adapter_gradients
from shardtune.model.lora_linear import use_fused_lora
from tests.unit.test_lora_linear import _Launches


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, skip_k: bool = False) -> torch.Tensor:
        k = torch.zeros_like(x[..., :16]) if skip_k else self.k(x)
        return self.o(torch.cat([self.q(x), k], dim=-1))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


class _Model(nn.Module):
    """Two blocks (a ModuleList's entries), each an attention-like and an MLP-like parent: 4 gradient blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attn": _Attn(), "mlp": _Mlp()}) for _ in range(2))

    def forward(self, x: torch.Tensor, skip_k: bool = False) -> torch.Tensor:
        for layer in self.layers:
            def block(h: torch.Tensor, layer: nn.Module = layer) -> torch.Tensor:
                h = h + layer["attn"](h, skip_k)
                return h + layer["mlp"](h)
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _pair() -> tuple[nn.Module, nn.Module]:
    """(autograd's sums, the blocks' sums): the same weights, bf16 base, fp32 adapters, lora_B non-zero."""
    torch.manual_seed(0)
    model = _Model()
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "o", "up", "down"]))
    for m in model.modules():
        if isinstance(m, PeftLoraLinear):
            nn.init.normal_(m.lora_B["default"].weight)
    for p in model.parameters():
        p.data = p.data.to(torch.float32 if p.requires_grad else torch.bfloat16)
    ours = copy.deepcopy(model)
    assert len(use_fused_lora(model)) == len(use_fused_lora(ours)) == 10
    assert take_adapter_gradients(ours) == 4
    return model, ours


def _micro_batches(model: nn.Module, n: int, **kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    for _ in range(n):
        x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
        model(x, **kw).float().square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_gradients_are_autograds_bit_for_bit_over_micro_batches() -> None:
    autograd, ours = _pair()
    want, got = _micro_batches(autograd, 3), _micro_batches(ours, 3)
    assert list(got) == list(want) and len(got) == 20
    for name, g in got.items():
        assert g.dtype == torch.float32 and torch.equal(g, want[name]), name
    # the first micro-batch's copy made each block's gradients one flat: views of it
    flats = {id(g._base) for g in got.values()}
    assert len(flats) == 4 and all(g._base is not None for g in got.values())


def test_one_kernel_per_block_moves_a_micro_batchs_gradients() -> None:
    autograd, ours = _pair()
    counts = {}
    for name, model in (("autograd", autograd), ("ours", ours)):
        _micro_batches(model, 1)  # .grad exist: the counted micro-batch accumulates
        with _Launches() as mode:
            _micro_batches(model, 1)
        counts[name] = mode.ops
    # autograd: a cast to fp32 and an add per adapter (20); ours: one add per block (4)
    assert counts["autograd"].count("_to_copy") - counts["ours"].count("_to_copy") == 20
    assert counts["autograd"].count("add_") - counts["ours"].count("add_") == 20 - 4
    assert len(counts["autograd"]) - len(counts["ours"]) == 20 + 20 - 4


def test_adapters_are_cast_once_per_block_after_an_optimizer_step() -> None:
    autograd, ours = _pair()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (autograd, ours)]
    for model, opt in zip((autograd, ours), opts, strict=True):
        _micro_batches(model, 1)
        opt.step()
        opt.zero_grad()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with _Launches() as mine:
        got = ours(x)
    assert torch.equal(got, autograd(x))  # the copies hold the stepped adapters
    # two blocks: one multi-tensor copy each, where each of the 10 layers cast its A and B (20 kernels)
    assert mine.ops.count("_foreach_copy_") == 2 and "_to_copy" not in mine.ops, mine.ops


def test_a_linear_left_out_and_a_replaced_grad_keep_the_sums() -> None:
    """k skipped in the second micro-batch (its block flushes at the end of the backward, k's part untouched), and
    a .grad replaced by the user between micro-batches (parameter by parameter from then on)."""
    autograd, ours = _pair()
    for model in (autograd, ours):
        _micro_batches(model, 1)
        q = model.layers[0]["attn"].q.lora_A["default"].weight
        q.grad = q.grad.clone()
    want, got = _micro_batches(autograd, 2, skip_k=True), _micro_batches(ours, 2, skip_k=True)
    for name, g in got.items():
        assert torch.equal(g, want[name]), name


def test_a_hooked_adapter_gets_its_gradient_through_autograd() -> None:
    _, ours = _pair()
    seen = []
    a = ours.layers[1]["mlp"].down.lora_A["default"].weight
    a.register_hook(lambda g: seen.append(g.dtype))
    _micro_batches(ours, 1)
    assert seen == [torch.float32]
    assert a.grad is not None and a.grad._base is None  # autograd's own tensor, not a block's flat


def test_blocks_keep_no_parameter_a_wrapper_replaced() -> None:
    """A sharding wrapper (FSDP2) replaces the adapters after injection: the blocks must not keep the originals
    alive (they did: tiny QLoRA on FSDP2 planned 8.41 MB, simulated 9.10 MB)."""
    import gc
    import weakref

    _, ours = _pair()
    lin = ours.layers[0]["attn"].q.lora_A["default"]
    old = weakref.ref(lin.weight)
    lin.weight = nn.Parameter(lin.weight.detach().clone())
    gc.collect()
    assert old() is None
