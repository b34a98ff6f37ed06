"""engine.offload_activations (engine/offload_activations.py) on CPU, in process: the same loss and gradients as
plain checkpointing, the unit inputs held in host buffers (counted apart by the tracker), not on the device."""
from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.config.load import load_recipe
from shardtune.config.schema import ModelConfig
from shardtune.data.packing import doc_lengths
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.errors import UserError
from shardtune.memory import CpuMemoryTracker
from shardtune.model.build import build_model

SEQ = 256


def _step(offload: bool):
    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    offloader = ActivationOffloader(torch.device("cpu")) if offload else None
    units = apply_activation_checkpointing(model, (LlamaDecoderLayer,), offloader=offloader)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # allocated before the tracker: only activations move the peak
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(100), torch.arange(SEQ - 100)])[None].repeat(2, 1)
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    try:
        loss = token_loss_sum(model, ids, ids, pos, chunk_tokens=128, doc_lengths=doc_lengths(pos.numpy()))
        loss.backward()
    finally:
        tracker.stop()
    grads = [p.grad for p in model.parameters()]
    return loss.detach(), grads, tracker.peak_bytes() - base, tracker.host_peak_bytes(), len(units), offloader


def test_offload_matches_checkpointing_and_moves_unit_inputs_to_host():
    loss, grads, peak, host, _, _ = _step(False)
    loss_o, grads_o, peak_o, host_o, units, off = _step(True)
    torch.testing.assert_close(loss_o, loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_o, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    one_input = 2 * SEQ * 128 * 4  # b·s·h fp32
    assert off.num_offloaded == units and off.num_fetched_ahead == units - 1
    assert host == 0 and host_o == units * one_input  # every unit input on the host at once, nothing else
    # On the device: all inputs but the one fetched back ahead plus the one being recomputed are gone.
    assert peak - peak_o >= (units - 3) * one_input, (peak, peak_o)


def test_offload_without_checkpointing_is_a_user_error():
    try:
        load_recipe("tiny-cpu", ["engine.offload_activations=true"])
    except UserError as e:
        assert "engine.offload_activations" in str(e) and "activation_checkpointing" in str(e)
    else:
        raise AssertionError("accepted offload_activations without activation_checkpointing")
