"""engine/checkpointing.py's recompute (one autograd Function a unit) on CPU, in process, against no checkpointing
and torch's non-reentrant checkpoint: the same loss and gradients, nothing recorded by the units' forward, the unit
inputs freed by the backward, and torch's checkpoint kept where a replay would differ."""
from __future__ import annotations

import functools
import weakref

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.config.schema import LoraConfig, ModelConfig
from shardtune.engine.checkpointing import apply_activation_checkpointing, replayable
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.wrap import resolve_unit_classes
from shardtune.model.build import build_model
from shardtune.model.lora import apply_lora
from shardtune.model.lora_linear import use_fused_lora
from shardtune.model.tiled_mlp import apply_sequence_chunking

SEQ = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(lora: bool, *, dropout: float = 0.0, config: str = "configs/models/tiny-llama.json") -> torch.nn.Module:
    torch.manual_seed(0)  # peft draws A from the global generator
    model = build_model(ModelConfig(config=config), seed=0)
    if lora:
        apply_lora(model, LoraConfig(enabled=True, r=8, target_modules=TARGETS, dropout=dropout))
        use_fused_lora(model)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # peft starts B at zero: a non-zero B makes the adapters' path count
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
    return model


class _Packs:
    """Saved tensors packed inside the units' own forward (their original forward, under the checkpoint), while on."""

    def __init__(self) -> None:
        self.count, self.on = 0, True

    def wrap(self, forward):
        @functools.wraps(forward)
        def run(*args, **kwargs):
            def pack(t):
                self.count += self.on
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return forward(*args, **kwargs)
        return run


def _step(lora: bool, how: str | None):
    """how: None (no checkpointing), "recompute" (ours) or "torch" (non-reentrant)."""
    model = _model(lora)
    units = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    packs = _Packs()
    inputs: list[weakref.ref] = []
    for unit in units:
        unit.forward = packs.wrap(unit.forward)
        unit.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    if how is not None:
        assert len(apply_activation_checkpointing(model, (LlamaDecoderLayer,), recompute=how == "recompute")) == len(units)
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(2, -1)
    loss = token_loss_sum(model, ids, ids, pos)
    packs.on = False  # the backward's recompute records its graph, as it must
    loss.backward()
    alive = sum(r() is not None for r in inputs[1:])  # `loss` still holds its graph here (a trainer's loop variable)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, packs.count, alive


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_recompute_matches_no_checkpointing_and_records_nothing_in_forward(lora: bool) -> None:
    loss, grads, packs, _ = _step(lora, None)
    loss_r, grads_r, packs_r, alive_r = _step(lora, "recompute")
    loss_t, _, packs_t, _ = _step(lora, "torch")
    assert torch.equal(loss_r, loss) and torch.equal(loss_t, loss)
    assert grads_r.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        # The same ops in the same order: equal to the bit. Under LoRA the first block's input needs no gradient
        # (frozen embeddings): its adapters' gradients arrive through the Function's anchor.
        assert grads_r[name] is not None and torch.equal(grads_r[name], g), name
    # The units' forward: without checkpointing and under the non-reentrant one (its hooks give the saved tensors
    # holders) every op saves what its backward reads; ours records no graph at all
    assert packs > 0 and packs_t == packs and packs_r == 0
    # The later units' inputs (earlier units' outputs) were kept for their recompute only: gone after the backward,
    # though `loss` and its graph are still referenced
    assert alive_r == 0


def test_torch_checkpoint_kept_where_a_replay_would_differ(tmp_path) -> None:
    plain = _model(True)
    assert all(replayable(u) for u in plain.modules() if isinstance(u, LlamaDecoderLayer))
    # dropout draws random numbers: only torch's checkpoint restores the RNG for the recompute
    dropped = _model(True, dropout=0.1)
    assert not any(replayable(u) for u in dropped.modules() if isinstance(u, LlamaDecoderLayer))
    # MoE routers: RouterBalance records their outputs in the grad-enabled forward
    moe = _model(False, config="configs/models/tiny-qwen3-moe.json")
    classes = resolve_unit_classes(moe, "auto")
    moe_units = [m for m in moe.modules() if isinstance(m, classes)]
    assert moe_units and not any(replayable(u) for u in moe_units)
    # chunks checkpointed inside (engine.mlp_chunk_tokens): a whole replay would run them a third time
    chunked = _model(False)
    units = [m for m in chunked.modules() if isinstance(m, LlamaDecoderLayer)]
    apply_sequence_chunking(units, chunk_tokens=32)
    assert not any(replayable(u) for u in units)
    # and such a unit takes torch's checkpoint: its forward records holders, as before
    apply_activation_checkpointing(chunked, (LlamaDecoderLayer,))
    assert all(isinstance(u.forward, functools.partial) and u.forward.func.__name__ == "checkpoint" for u in units)
