"""Kernel launches per decoder layer of a LoRA step on the simulated GPU (issue 58): tiny-lora-cpu planned for a
GPU (bf16, checkpointing, 2 ranks, varlen attention) with 2 decoder layers against 1, one micro-batch. What one
layer costs is what a deep model's step scales with (the 1B Llama: 16 layers x 4 micro-batches)."""
from __future__ import annotations

from pathlib import Path

from shardtune.plan.simulate import simulate
from shardtune.simulated.launches import PHASES
from tests.simulated.shallow import shallow_config

TINY = ["launch.device=cuda", "hardware.gpu=rtx4090-24gb", "engine.cpu_offload=false", "train.grad_accum=1"]


def _by_phase(layers: int, tmp: Path) -> dict[str, int]:
    from shardtune.model.attention import _cu_seqlens

    _cu_seqlens.cache_clear()  # each run copies its documents' offsets, as a run's first step does
    return simulate("tiny-lora-cpu", [*TINY, shallow_config("tiny-lora-cpu", layers, tmp)]).to_json()[
        "launches"]["by_phase"]


def test_launches_per_decoder_layer(tmp_path: Path) -> None:
    """Per layer: 7 LoRA Linears (3 kernels forward, 3 again in the recompute, 5 backward, 2 casts of the
    adapters' gradients back to fp32, 1 add each into the replicated bucket), q and k rotated together (6 kernels
    each way: model/rotary.py), the norms, the MLP's activation, the residual sums, varlen attention. Was 229 (58
    forward, 21 recompute, 148 backward, 2 communication) before the rotary Function and before the replicated
    adapters' hook stopped handing autograd zeros (engine/replicated.py). The recompute replays the whole unit
    (engine/checkpointing.py): its last residual sum too, 1 kernel that torch's checkpoint stopped before."""
    one, two = _by_phase(1, tmp_path), _by_phase(2, tmp_path)
    layer = {p: two[p] - one[p] for p in PHASES}
    assert layer["optimizer"] == 0, layer
    assert layer["forward"] <= 54 and layer["recompute"] <= 12 and layer["backward"] <= 116, layer
    assert sum(layer.values()) <= 183, layer
