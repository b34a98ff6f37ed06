"""The training step on the simulated GPU, run inside simulated ranks (harness.py): the real `train.setup`,
`train_step`, `save_checkpoint` and `resume`, with a tiny recipe."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune import train as T
from shardtune.config.load import load_recipe
from shardtune.runtime import all_reduce_max
from shardtune.signals import StopRequest

BASE = ("data.num_samples=48", "data.seq_len=32", "data.eval_fraction=0.1", "train.micro_batch_size=1",
        "train.max_steps=2", "train.save_every=0", "train.demo_eval=false", "train.keep_last=0")
LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8")

# name -> recipe overrides. Strategy, precision, checkpointing, offload, LoRA/QLoRA and the torch backend.
# hybrid_offload: full fine-tuning keeps the vocabulary tables' gradients on the host, summed over the replicas.
SETTINGS = {
    "full_shard": (),
    "shard_grad_op": ("engine.strategy=shard_grad_op",),
    "no_shard": ("engine.strategy=no_shard",),
    "hybrid": ("engine.strategy=hybrid_shard", "engine.hybrid_shard_size=2"),
    "bf16_ac": ("engine.mixed_precision=bf16", "engine.reduce_dtype=bf16", "engine.activation_checkpointing=true"),
    "offload": ("engine.cpu_offload=true",),
    "offload_bf16_accum": ("engine.cpu_offload=true", "engine.mixed_precision=bf16", "train.grad_accum=2"),
    "lora": LORA,
    "lora_offload": (*LORA, "engine.cpu_offload=true"),
    "qlora": (*LORA, "lora.quantize_base=nf4", "engine.mixed_precision=bf16"),
    "qlora_offload": (*LORA, "lora.quantize_base=nf4", "engine.cpu_offload=true"),
    "torch": ("engine.backend=torch",),
    "hybrid_offload": ("engine.strategy=hybrid_shard", "engine.hybrid_shard_size=2", "engine.cpu_offload=true"),
}


def build(out: str, overrides: tuple[str, ...]) -> T.Run:
    cache = Path(out).parent / "data-cache"  # one tokenized cache for every setting of a start
    recipe = load_recipe("tiny-cpu", [f"train.output_dir={out}", f"data.cache_dir={cache}", *BASE, *overrides])
    return T.setup(recipe, simulated=True)


def states_on_expected_devices(run: T.Run) -> None:
    """Sharded states where the recipe puts them: the simulated GPU, or the host under offload; AdamW's step
    where its kernel reads it (accelerator.step_tensor)."""
    offload = run.recipe.engine.cpu_offload
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            adapter = run.recipe.lora.enabled
            want = "meta" if adapter or not offload else "cpu"
            assert p.device.type == want, (p.device, want)
            st = run.optimizer.state[p]
            assert st["exp_avg"].device == p.device
            step_dev = p.device.type if group.get("fused") else "cpu"
            assert st["step"].device.type == step_dev, (st["step"].device, group.get("fused"))


def train_save_resume(name: str, out: str) -> None:
    """One step, a DCP save, a resume load into the same run, one more step."""
    run = build(out, SETTINGS[name])
    assert run.rt.device == accelerator.SIMULATED
    record = T.train_step(run, 0, None)
    assert record["step"] == 1
    traced = [e for e in accelerator.TRACE.entries if e[0] == "op"]
    if run.recipe.engine.backend == "shardtune":  # our engine's collectives all ran on the simulated GPU
        assert record["comm_bytes"] > 0  # FSDP2 counts none
        assert any(e[2] == "all_gather" for e in traced) or run.recipe.engine.strategy == "no_shard"
        assert any(e[2] in ("reduce_scatter", "all_reduce") for e in traced)
    T.save_checkpoint(run, 1)
    ckpt = Path(out) / "checkpoints" / "step_1"
    assert (ckpt / ".metadata").is_file() and (Path(out) / "checkpoints" / "latest").read_text() == "step_1"
    assert T.resume(run) == 1
    states_on_expected_devices(run)
    record = T.train_step(run, 1, None)
    assert record["step"] == 2
    # The other collectives of a training loop, on the device: the stop agreement and the memory maximum.
    assert not StopRequest().agreed(run.rt.device)
    assert all_reduce_max(1.0, run.rt.device) == 0.0  # a host read of the simulated GPU gives zeros
    dist.barrier(group=accelerator.host_group())


def shared_dir(base: str, name: str) -> str:
    path = Path(base) / f"{name}-w{dist.get_world_size()}"
    return str(path)


def run_settings(base: str, names: list[str]) -> None:
    for name in names:
        torch.manual_seed(0)
        train_save_resume(name, shared_dir(base, name))
