"""engine.offload_activations on 2 ranks: full fine-tuning, LoRA and QLoRA on our engine (with and without
cpu_offload) and on FSDP2, 8 steps each, against one process running plain activation checkpointing: per-step loss
within 1e-5 relative (fp32). And the per-document attention (model/attention.py) on packed rows, full / LoRA / QLoRA on 2
ranks against one process. One spawn for the whole grid."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, policy_for
from tests.distributed.harness import run_distributed
from tests.distributed.test_chunked_loss import _model, _steps, nf4_reference_weights
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.data import packing
from shardtune.data.formats import IGNORE
from shardtune.engine import shard as shardtune_backend
from shardtune.engine import torch_backend
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import resolve_unit_classes
from shardtune.model import attention
from shardtune.model.lora import is_adapter

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


DOCS = (5, 7, 4)  # one packed row of 16 tokens: three documents


def _document_model(name: str):
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(str(CONFIGS_DIR / "models" / f"{name}.json"))
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.register()).float()


def _packed_steps(model, sharded, opt, steps: int = 4) -> list[float]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded is not None else (0, 1)
    pos = torch.cat([torch.arange(n) for n in DOCS]).expand(4, -1)
    lengths = packing.doc_lengths(pos.numpy())
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(3, 128, (4, sum(DOCS)), generator=g)
        labels = ids.clone()
        labels[:, [0, DOCS[0], DOCS[0] + DOCS[1]]] = IGNORE  # as packing masks each document's first label
        total = int((labels[:, 1:] != IGNORE).sum())
        mine = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = token_loss_sum(model, ids[mine], labels[mine], pos[mine], doc_lengths=lengths[mine]) / total
        loss.backward()
        loss = loss.detach()
        if sharded is not None:
            dist.all_reduce(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def packed_reference(mode: str) -> list[float]:
    """One process, the plain block: the per-step losses of `_packed_steps`."""
    ref_model = _model("tiny-llama", mode, build=_document_model)
    if mode == "qlora":
        nf4_reference_weights(ref_model)
    return _packed_steps(ref_model, None, adamw(ref_model))


def _packed_parity(mode: str) -> None:
    """Packed rows through the per-document attention: 2 ranks equal one process."""
    ref = packed_reference(mode)
    model = _model("tiny-llama", mode, build=_document_model)
    policy = policy_for(model, "full_shard", world=dist.get_world_size())
    if mode != "full":
        policy = dataclasses.replace(policy, replicated=lambda n, p: is_adapter(n), quantize_base=mode == "qlora")
    sharded = shardtune_backend.shard_model(model, policy, device=CPU)
    losses = _packed_steps(model, sharded, adamw(sharded.optimizer_param_groups(0.1)))
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)


def _check(kind: str, **setting) -> None:
    (_packed_parity if kind == "packed" else _parity)(**setting)


def test_offload_activations_and_packed_attention_parity():
    offload = ({"mode": "full"}, {"mode": "lora", "cpu_offload": True}, {"mode": "qlora"},
               {"mode": "full", "backend": "torch"})
    settings = [{"kind": "offload", **s} for s in offload]
    settings += [{"kind": "packed", "mode": m} for m in ("full", "lora", "qlora")]
    run_distributed(_check, 2, settings)
