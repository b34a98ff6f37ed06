"""engine.mlp_chunk_tokens on a LoRA model (tiled_mlp.apply_sequence_chunking: MLP, norms, adapter branches through
chunked_lora.LoraDelta), one process: the same loss as peft's own path (bit for bit: the same elementwise operations) and
gradients within 1e-5, in fp32 and with a bf16 base (fp32 adapters: peft's casts), under activation checkpointing;
and no fp32 tensor as wide as the hidden size and as long as the whole sequence is ever created."""
from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import Linear as PeftLoraLinear
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.config.schema import LoraConfig, ModelConfig
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.wrap import find_units
from shardtune.model.build import build_model
from shardtune.model.lora import apply_lora
from shardtune.model.tiled_mlp import apply_sequence_chunking

SEQ, CHUNK, HIDDEN = 96, 40, 64  # tiny-llama's hidden size; 40 does not divide 2 x 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _WholeFp32(TorchDispatchMode):
    """Counts fp32 tensors of [.., HIDDEN] holding every token of the micro-batch (peft's input casts, the norms'
    upcasts) made inside a decoder block's forward or recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.in_block = False

    def block(self, forward):
        def run(*args, **kwargs):
            self.in_block = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_block = False
        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out if self.in_block else ()):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.ndim >= 2 and t.shape[-1] == HIDDEN
                    and t.numel() == 2 * SEQ * HIDDEN):
                self.count += 1
        return out


def _run(chunk: int, base_dtype: torch.dtype, *, peft_forward: bool = True):
    torch.manual_seed(0)
    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    apply_lora(model, LoraConfig(enabled=True, r=8, target_modules=TARGETS))
    if peft_forward:  # peft's own forward, not model/lora_linear.py's (which runs the adapters in the compute dtype)
        for m in model.modules():
            if isinstance(m, PeftLoraLinear):
                m.__class__ = PeftLoraLinear
    for n, p in model.named_parameters():
        if "lora_B" in n:  # peft starts B at zero: a non-zero B makes the adapters' path count
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
        if not p.requires_grad:  # as parallelize stores a frozen base under bf16 compute
            p.data = p.data.to(base_dtype)
    units = find_units(model, (LlamaDecoderLayer,), None)
    if chunk:
        changed = apply_sequence_chunking(units, chunk_tokens=chunk)
        assert len(changed["adapters"]) == len(TARGETS) * len(units)
    seen = _WholeFp32()
    for unit in units:  # inside the checkpointed region: the recompute counts too
        unit.forward = seen.block(unit.forward)
    apply_activation_checkpointing(model, (LlamaDecoderLayer,))
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(2, -1)
    with seen:
        loss = token_loss_sum(model, ids, ids, pos)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, seen.count


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-base"])
def test_chunked_adapters_match_peft_with_no_whole_fp32_copy(base_dtype):
    loss, grads, whole = _run(0, base_dtype)
    loss_c, grads_c, whole_c = _run(CHUNK, base_dtype)
    assert torch.equal(loss_c, loss)
    assert grads_c.keys() == grads.keys()
    for name in grads:
        # sums over chunks in another order: within 1e-5 of the gradient's scale
        assert (grads_c[name] - grads[name]).abs().max() <= 1e-5 * grads[name].abs().max(), name
    if base_dtype == torch.bfloat16:  # (in fp32 every activation is fp32)
        assert whole > 0  # peft's path casts whole inputs to fp32, the norms upcast them
        assert whole_c == 0, whole_c


def test_chunked_adapters_match_the_fused_lora_linear_in_fp32():
    """Without chunking the adapters run through model/lora_linear.py: in fp32 the same sums in another order."""
    loss, grads, _ = _run(0, torch.float32, peft_forward=False)
    loss_c, grads_c, _ = _run(CHUNK, torch.float32, peft_forward=False)
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)
    for name in grads:
        assert (grads_c[name] - grads[name]).abs().max() <= 1e-5 * grads[name].abs().max(), name
