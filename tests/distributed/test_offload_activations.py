"""engine.offload_activations on 2 ranks: full fine-tuning, LoRA and QLoRA on our engine (with and without
cpu_offload) and on FSDP2, 8 steps each, against one process running plain activation checkpointing: per-step loss
within 1e-5 relative (fp32). One spawn for the whole grid."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, policy_for
from tests.distributed.harness import run_distributed
from tests.distributed.test_chunked_loss import _model, _steps, nf4_reference_weights

from shardtune.engine import shard as shardtune_backend
from shardtune.engine import torch_backend
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import resolve_unit_classes
from shardtune.lora import is_adapter

CPU = torch.device("cpu")


@functools.cache
def _reference(mode: str) -> list[float]:
    model = _model("tiny-llama", mode)
    if mode == "qlora":
        nf4_reference_weights(model)
    apply_activation_checkpointing(model, resolve_unit_classes(model, "auto"))
    return _steps(model, None, adamw(model), chunk=0)


def _parity(mode: str, backend: str = "shardtune", cpu_offload: bool = False) -> None:
    ref = _reference(mode)
    model = _model("tiny-llama", mode)
    policy = policy_for(model, "full_shard", world=dist.get_world_size())
    policy = dataclasses.replace(policy, cpu_offload=cpu_offload, offload_activations=True)
    if mode != "full":
        policy = dataclasses.replace(policy, replicated=lambda n, p: is_adapter(n), quantize_base=mode == "qlora")
    offloader = ActivationOffloader(CPU)
    apply_activation_checkpointing(model, policy.unit_classes, offloader=offloader)
    if backend == "torch":
        if mode == "qlora":
            from shardtune.engine.layout import group_unit_params
            from shardtune.engine.nf4 import quantize_parameters

            quantize_parameters(model, [e for up in group_unit_params(model, policy) for e in up.quantized],
                                torch.float32)
        sharded = torch_backend.shard_model(model, policy, device=CPU)
    else:
        sharded = shardtune_backend.shard_model(model, policy, device=CPU)
    losses = _steps(model, sharded, adamw(sharded.optimizer_param_groups(0.1)), chunk=0)
    assert offloader.num_offloaded > 0 and not offloader._stash  # every stashed input came back
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)


def test_offload_activations_parity():
    settings = [{"mode": "full"}, {"mode": "lora", "cpu_offload": True}, {"mode": "qlora"},
                {"mode": "full", "backend": "torch"}]
    run_distributed(_parity, 2, settings)
