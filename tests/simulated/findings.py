"""The three GPU crashes of issue 20, each run on the simulated GPU inside simulated ranks (test_findings.py)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.checkpoint import manager
from shardtune.engine import state_dict
from shardtune.engine.shard import shard_model
from tests.distributed.common import build_model, policy_for

SIM = accelerator.SIMULATED


def _scheduler() -> torch.optim.lr_scheduler.LRScheduler:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def checkpoint_agreement(out: str) -> None:
    """Finding 1: every save ends with the ranks agreeing that it succeeded. On an NCCL-like default group a host
    flag is refused ("No backend type associated with device type cpu"): the agreement, the barriers and DCP's
    planning must run where host objects can go (the host group)."""
    mgr = manager.CheckpointManager(Path(out), keep_last=0, is_main=dist.get_rank() == 0, rank=dist.get_rank(),
                                    device=SIM)
    state = {"w": torch.zeros(8, device=SIM), "optim.step": torch.tensor(3.0)}
    saved = mgr.save(5, state, _scheduler(), {"world_size": dist.get_world_size()})
    assert saved is not None and (saved / ".metadata").is_file(), "the save failed: see the warning"
    assert manager.load(saved, state, _scheduler(), rank=dist.get_rank(), world_size=dist.get_world_size(),
                        device=SIM) == 5


def _offloaded(lora: bool) -> tuple:
    model = build_model("tiny-llama")
    policy = policy_for(model, "full_shard", world=dist.get_world_size())
    policy = type(policy)(**{**policy.__dict__, "cpu_offload": True})
    sharded = shard_model(model, policy, device=SIM)
    groups = sharded.optimizer_param_groups(0.1)
    return sharded, groups


def offload_checkpoint_state(out: str) -> None:
    """Finding 2: full fine-tuning with cpu_offload keeps each shard in pinned host memory; the checkpoint must
    describe its chunks as pinned, or ShardedTensor refuses them (on save and on resume)."""
    sharded, groups = _offloaded(lora=False)
    shards = [p for g in groups for p in g["params"]]
    assert shards and all(p.device.type == "cpu" and p.is_pinned() for p in shards)  # what offload does on a GPU
    opt = torch.optim.AdamW(groups, lr=1e-3, **accelerator.optimizer_flags(shards))
    for for_load in (False, True):
        state = sharded.checkpoint_state(opt, for_load=for_load)  # raised on main: pin_memory=False
        sharded_keys = {k: v for k, v in state.items() if hasattr(v, "local_shards")}
        model_chunks = [s.tensor for k, v in sharded_keys.items() if k.startswith("model.") for s in v.local_shards()]
        assert model_chunks and all(t.is_pinned() for t in model_chunks)  # views of the pinned shards
        for v in sharded_keys.values():  # AdamW's moments are torch's own (unpinned) tensors: described as such
            pinned = {s.tensor.is_pinned() for s in v.local_shards()}
            assert pinned <= {v.metadata().tensor_properties.pin_memory}


def fused_step_placement(out: str) -> None:
    """Finding 3: AdamW's fused (and capturable) kernels read `step` on the parameter's device. The optimizer for
    adapters on the GPU (LoRA under offload) must not be a fused one with a host step, and the step tensors
    created for a checkpoint load and set after it follow the kernel's placement."""
    from shardtune.config.schema import TrainConfig
    from shardtune.trainer.train import build_optimizer

    adapters = [torch.nn.Parameter(torch.zeros(4, 4, device=SIM)) for _ in range(2)]

    class Adapters:  # the sharded model's optimizer interface, LoRA under offload: adapters stay on the device
        def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
            return [{"params": adapters, "weight_decay": weight_decay}]

    opt = build_optimizer(Adapters(), TrainConfig())  # raised on main: fused=True for device params
    for p in adapters:
        p.grad = torch.zeros_like(p)
    state_dict.init_optimizer_state(opt)
    for group in opt.param_groups:
        for p in group["params"]:
            step = opt.state[p]["step"]
            assert step.device == (p.device if group["fused"] else torch.device("cpu")), (group["fused"], step.device)
    opt.step()
    # The rule for a fused group (its kernel cannot run on meta, so the group is marked fused after construction).
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device=SIM))], lr=1e-3)
    fused.param_groups[0]["fused"] = True
    state_dict.init_optimizer_state(fused)
    (p,) = fused.param_groups[0]["params"]
    assert fused.state[p]["step"].device == p.device, "a fused kernel would read a host step as a device address"
    state_dict.after_load({"optim.step": torch.tensor(7.0)}, fused)
    assert fused.state[p]["step"].device == p.device


def host_tensor_refused(out: str) -> None:
    """What makes every simulated test a device check: the default group refuses a host tensor as NCCL does,
    and the host group takes it."""
    try:
        dist.all_reduce(torch.zeros(1))
    except RuntimeError as e:
        assert "No backend type associated with device type cpu" in str(e)
    else:
        raise AssertionError("the simulated GPU's group took a host tensor")
    t = torch.ones(1)
    dist.all_reduce(t, group=accelerator.host_group())
    assert t.item() == dist.get_world_size()


def torch_offload_collectives(out: str) -> None:
    """engine.backend=torch under cpu_offload: FSDP2's parameters and gradients are host DTensors on the device
    mesh. The norm, the full state dict and the export (full_tensor) gather them on the device: DTensor's own
    reductions would hand the device group a host tensor ("No backend type associated with device type cpu", as
    NCCL says). FSDP2 shards a model built on meta and materialises the shards on the host (its deferred init);
    no step (its offload copies each gradient to the host, which a meta tensor cannot give): the gradients are
    what its step leaves, host DTensors like the parameters."""
    import dataclasses

    from torch.distributed.tensor import DTensor

    from shardtune.engine import torch_backend

    with torch.device(SIM):
        model = build_model("tiny-llama")
    policy = dataclasses.replace(policy_for(model, "full_shard", world=dist.get_world_size()), cpu_offload=True)
    sharded = torch_backend.shard_model(model, policy, device=SIM)
    for m in sharded._fsdp_modules:  # real host tensors here (what the device group must refuse), and a CPU build
        for fsdp_param in m._get_fsdp_state()._fsdp_param_group.fsdp_params:  # cannot pin them
            fsdp_param.pin_memory = False
    model.to_empty(device="cpu")
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.to_local().device.type == "cpu"
        p.grad = torch.ones_like(p)
    norm = sharded.clip_grad_norm_(1.0)
    assert norm.device == SIM and norm.shape == ()
    assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())  # clipped where FSDP2 keeps it
    head = torch_backend.full_tensor(model.lm_head.weight)
    assert head.device == SIM and head.shape == (model.config.vocab_size, model.config.hidden_size)
    if dist.get_rank() != 0:  # rank 0 copies the gathered values to the host, which a meta tensor cannot give
        assert list(sharded.full_state_dict()) == []


def run_findings(base: str, names: list[str]) -> None:
    for name in names:
        out = str(Path(base) / name)
        globals()[name](out)
        dist.barrier(group=accelerator.host_group())
